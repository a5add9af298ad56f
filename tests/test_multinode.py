"""Multi-node launch: the SLURM script's dry run, and 2 "nodes" on localhost (two launchers, machine ranks 0 and 1).

The localhost test runs the sbatch script's per-node task twice, as ``srun`` would on two nodes, with faked SLURM
variables: each starts ``accelerate launch --num_machines 2 --num_processes 2 --machine_rank r
--main_process_ip 127.0.0.1 ...`` with one process, and together they train the tiny recipe as one world of 2
whose run equals a single process's with the same global batch (fp32, ``parity.assert_parity``: the logged losses and
gradient norms, and the final weights node 0 saved).
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dist_utils import free_port
from launch_harness import ROOT, TRAIN, launch_env, launched_run
from parity import assert_parity

SBATCH = ROOT / "examples" / "multinode" / "harbor_13b_2x8.sbatch"
TINY = [
    "--num_conversations", "160", "--max_seq_len", "64", "--eval_fraction", "0", "--global_batch_size", "8",
    "--per_device_train_batch_size", "2", "--max_steps", "3", "--logging_steps", "1",
]
FAKE_SCONTROL = """#!/usr/bin/env bash
echo "$@" >> "$(dirname "$0")/calls"
[[ "$1 $2" == "show hostnames" ]] || exit 2
echo gpu-01; echo gpu-02
"""


def _env(tmp_path: Path, **extra: str) -> dict:
    """``launch_env()`` outside SLURM and any rendezvous, with a fake ``scontrol`` first on the PATH."""
    env = {k: v for k, v in launch_env().items()
           if not k.startswith("SLURM_") and k not in ("MASTER_ADDR", "MASTER_PORT")}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env.update(extra)
    return env


def test_the_2x8_config_spans_two_machines():
    config = yaml.safe_load((ROOT / "accelerate_configs" / "harbor_13b_fsdp_2x8.yaml").read_text())
    assert (config["num_machines"], config["num_processes"], config["distributed_type"]) == (2, 16, "FSDP")


def test_dry_run_prints_each_nodes_command(tmp_path):
    env = _env(tmp_path, DRY_RUN="1", SLURM_JOB_NODELIST="gpu-[01-02]", SLURM_NNODES="2")
    args = ["--model_name_or_path", "meta-llama/Llama-2-13b-hf", "--data_path", "/shared/my data.jsonl"]
    proc = subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "bin" / "calls").read_text().splitlines()[0] == "show hostnames gpu-[01-02]"
    nodes = [line for line in proc.stdout.splitlines() if line.startswith("node ")]
    assert len(nodes) == 2
    for rank, line in enumerate(nodes):
        argv = shlex.split(line.split(" && ", 1)[1])
        assert argv[:2] == ["accelerate", "launch"]
        flags = dict(zip(argv[2:22:2], argv[3:22:2]))
        assert flags == {
            "--config_file": "accelerate_configs/harbor_13b_fsdp_2x8.yaml", "--num_machines": "2",
            "--num_processes": "16", "--machine_rank": str(rank), "--main_process_ip": "gpu-01",
            "--main_process_port": "29500", "--rdzv_backend": "static",
            "examples/harbor/train.py": "--preset", "13b": "--resume_from_checkpoint",
            "auto": "--model_name_or_path",  # a requeued job resumes
        }
        assert argv[-2:] == ["--data_path", "/shared/my data.jsonl"]  # quoted through, one argument


def test_outside_slurm_the_script_says_what_is_missing(tmp_path):
    proc = subprocess.run(["bash", str(SBATCH)], env=_env(tmp_path, DRY_RUN="1"), capture_output=True, text=True)
    assert proc.returncode != 0
    assert "not inside a SLURM allocation" in proc.stderr


def _node(tmp_path: Path, rank: int, port: int) -> subprocess.Popen:
    env = _env(
        tmp_path, HARBOR_NODE_TASK="1", SLURM_NODEID=str(rank), SLURM_NNODES="2", SLURM_JOB_NODELIST="localhost",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GPUS_PER_NODE="1", CONFIG="accelerate_configs/ddp.yaml",
        PRESET="tiny", REPO=str(ROOT),
    )
    # each "node" has its own disk, as nodes without a shared filesystem do: --save_on_each_node says so
    cmd = ["bash", str(SBATCH), *TINY, "--save_on_each_node", "true", "--output_dir", str(tmp_path / f"node{rank}")]
    log = open(tmp_path / f"node{rank}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    cmd = [sys.executable, str(TRAIN), "--preset", "tiny", *TINY,
           "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(out), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return launched_run(out)


def test_two_nodes_on_localhost_train_as_one_world(tmp_path, single_process):
    port = free_port()
    nodes = [_node(tmp_path, rank, port) for rank in (0, 1)]
    codes = [node.wait(timeout=900) for node in nodes]  # a hang guard (rendezvous never met), not a timing
    logs = [(tmp_path / f"node{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [0, 0], f"node logs:\n{logs[0][-3000:]}\n----\n{logs[1][-3000:]}"
    assert "--machine_rank 1 --main_process_ip 127.0.0.1" in logs[1]
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["layout"].endswith("DDP (MULTI_CPU)")
    assert any(line.split() == ["world", "size", "2"] for line in logs[0].splitlines())
    records = [json.loads(line) for line in (tmp_path / "node0" / "log_history.jsonl").read_text().splitlines()]
    assert all("peak_memory_gb/rank1" in r for r in records if "loss" in r)  # figures gathered from both nodes
    assert not (tmp_path / "node1" / "summary.json").exists()  # only the global main process writes it
    assert_parity(launched_run(tmp_path / "node0"), single_process, what="2 nodes")
