"""examples/multinode/harbor_13b_k8s.yaml cannot rot silently.

The manifest is parsed (``yaml.safe_load_all``); its torchrun command line goes through torchrun's own argument
parser and the recipe's (``examples/harbor/train.py`` ``parse``, at every world size the elastic range allows);
the pieces that must agree are compared (rendezvous Service and store port, GPUs and ``--nproc-per-node``, grace
period and ``--shutdown-timeout``, the failure policy and hf_dist's preemption exit code); and the pod's shell
wrapper is run for real with a stand-in for torchrun to check the exit code Kubernetes sees. The last test runs
the store and two pods' commands on localhost (tiny model, one rank each) and terminates one pod as the kubelet
would. No cluster is needed.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dist_utils import load_recipe
from torch.distributed.run import get_args_parser

from hf_dist.trainer.args import resolve_contract
from hf_dist.trainer.preemption import PREEMPTED_EXIT_CODE
from hf_dist.trainer.resume import parse_resume

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "multinode" / "harbor_13b_k8s.yaml"
REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")  # Kubernetes' $(VAR) in command and args


def _objects() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    assert len({d["kind"] for d in docs}) == len(docs), "one object of each kind"
    return {d["kind"]: d for d in docs}


def _trainer() -> dict:
    (container,) = _objects()["Job"]["spec"]["template"]["spec"]["containers"]
    return container


def _expanded_args(container: dict, values: dict[str, str]) -> list[str]:
    """The container's args with ``$(VAR)`` replaced as the kubelet does (only variables the container defines)."""
    defined = {e["name"] for e in container.get("env", [])}

    def substitute(match: re.Match) -> str:
        name = match.group(1)
        assert name in defined, f"$({name}) is not in the container's env: Kubernetes would pass it literally"
        return values[name]

    return [REFERENCE.sub(substitute, arg) for arg in container["args"]]


def pod_command(values: dict[str, str]) -> list[str]:
    """What the trainer container runs, ``$(VAR)`` expanded from ``values`` (also used to run it on localhost)."""
    container = _trainer()
    return container["command"] + _expanded_args(container, values)


def _torchrun():
    args = _expanded_args(_trainer(), {"POD_IP": "10.0.0.7", "JOB_UID": "0f6c"})
    assert args[0] == "torchrun", args[:1]
    return get_args_parser().parse_args(args[1:])


def _node_range(torchrun) -> tuple[int, int]:
    low, _, high = torchrun.nnodes.partition(":")
    return int(low), int(high or low)


def test_torchrun_command_is_elastic_and_matches_the_job():
    objects, torchrun = _objects(), _torchrun()
    job, service, store = objects["Job"], objects["Service"], objects["Deployment"]
    low, high = _node_range(torchrun)
    assert 1 <= low < high == job["spec"]["completions"] == job["spec"]["parallelism"], torchrun.nnodes
    assert job["spec"]["completionMode"] == "Indexed"
    assert torchrun.rdzv_backend == "c10d" and torchrun.max_restarts > 0
    conf = dict(item.split("=", 1) for item in torchrun.rdzv_conf.split(","))
    assert conf["is_host"] == "false"  # the store runs in its own pod, no agent hosts it
    host, port = torchrun.rdzv_endpoint.split(":")
    assert host == service["metadata"]["name"] and int(port) == service["spec"]["ports"][0]["port"]
    (store_container,) = store["spec"]["template"]["spec"]["containers"]
    target = service["spec"]["ports"][0]["targetPort"]
    assert target == store_container["ports"][0]["containerPort"]
    assert f"TCPStore(\"0.0.0.0\", {target}, is_master=True" in store_container["command"][-1]
    assert service["spec"]["selector"] == store["spec"]["template"]["metadata"]["labels"]
    assert torchrun.local_addr == "10.0.0.7" and torchrun.rdzv_id == "0f6c"
    container = _trainer()
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == int(torchrun.nproc_per_node)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # see examples/multinode/elastic.sh
    assert (ROOT / torchrun.training_script).is_file(), torchrun.training_script


def test_preemption_is_not_a_failure():
    spec = _objects()["Job"]["spec"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    # the grace period covers torchrun's wait for the ranks (one step and a save) after SIGTERM
    assert pod["terminationGracePeriodSeconds"] > _torchrun().shutdown_timeout > 0
    rules = spec["podFailurePolicy"]["rules"]
    exit_rule = next(r for r in rules if "onExitCodes" in r)
    assert exit_rule["action"] == "Ignore" and exit_rule["onExitCodes"]["operator"] == "In"
    assert exit_rule["onExitCodes"]["values"] == [PREEMPTED_EXIT_CODE]
    assert exit_rule["onExitCodes"]["containerName"] == _trainer()["name"]
    disruption = next(r for r in rules if "onPodConditions" in r)
    assert disruption["action"] == "Ignore" and disruption["onPodConditions"] == [{"type": "DisruptionTarget"}]
    assert spec["successPolicy"]["rules"] == [{"succeededCount": 1}]


def test_recipe_accepts_the_arguments_at_every_world_size(monkeypatch):
    torchrun, recipe = _torchrun(), load_recipe()
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    # the recipe's parser and its checks (--use_cpu: bf16 is refused on a machine with no GPU, like this one)
    script, args = recipe.parse([*torchrun.training_script_args, "--use_cpu", "true"])
    assert parse_resume(args.resume_from_checkpoint) == "auto"  # a fresh start, then every restart resumes
    assert args.save_strategy == "steps" and args.save_steps >= 1
    assert args.fsdp2
    mount = {m["name"]: m["mountPath"] for m in _trainer()["volumeMounts"]}["shared"]
    for path in (args.output_dir, script.model_name_or_path, script.data_path):
        assert path.startswith(mount + "/"), f"{path} is not on the shared volume {mount}"
    low, high = _node_range(torchrun)
    for nodes in range(low, high + 1):  # every world the pods can form: the same global batch, accumulation derived
        contract = resolve_contract(
            world_size=nodes * int(torchrun.nproc_per_node), micro_batch_size=args.per_device_train_batch_size,
            global_batch_size=args.global_batch_size, tp_size=args.tp_size, pp_size=args.pp_size,
        )
        assert contract.global_batch_size == args.global_batch_size


def _run_wrapper(child: str, *, terminate: bool) -> tuple[int, str]:
    """The container's command with ``child`` (Python code) standing in for torchrun; SIGTERM it like the kubelet."""
    command = _trainer()["command"] + [sys.executable, "-c", child]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    if terminate:
        proc.send_signal(signal.SIGTERM)  # to the shell only, as Kubernetes signals PID 1
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


CHILD = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (print("child got SIGTERM", flush=True), sys.exit({on_term})))
print("ready", flush=True)
{then}
"""


@pytest.mark.parametrize(
    ("on_term", "then", "terminate", "expected"),
    [
        (1, "time.sleep(60)", True, PREEMPTED_EXIT_CODE),  # torchrun exits 1 after its ranks saved
        (0, "time.sleep(60)", True, 0),  # it had finished anyway
        (1, "sys.exit(0)", False, 0),
        (1, "sys.exit(3)", False, 3),  # a real failure stays one
    ],
)
def test_pod_wrapper_exit_codes(on_term, then, terminate, expected):
    code, out = _run_wrapper(CHILD.format(on_term=on_term, then=then), terminate=terminate)
    assert code == expected, out
    assert ("child got SIGTERM" in out) == terminate  # passed on to torchrun


def _localhost_pod(port: int, out: Path) -> list[str]:
    """The trainer container's command as a pod on localhost: 1 rank, the tests' recording recipe, tiny model."""
    from test_elastic import RECORDING, TINY

    container = _trainer()
    args = _expanded_args(container, {"POD_IP": "127.0.0.1", "JOB_UID": f"k8s-{port}"})
    local = {"--nproc-per-node": "1", "--rdzv-endpoint": f"127.0.0.1:{port}"}
    flags = []
    for arg in args[1:args.index(_torchrun().training_script)]:
        name = arg.split("=", 1)[0]
        flags.append(f"{name}={local[name]}" if name in local else arg.replace("last_call_timeout=30",
                                                                              "last_call_timeout=3"))
    return container["command"] + ["torchrun", *flags, str(RECORDING), *TINY, "--resume_from_checkpoint", "auto",
                                   "--output_dir", str(out)]


def test_pods_on_localhost_one_terminated(tmp_path):
    """The manifest's rendezvous store and two pods' commands on localhost; SIGTERM to one pod's shell (PID 1).

    That pod exits 75 (which the failure policy ignores) after every rank stopped at the same step and saved;
    the other pod's agent restarts its rank in a world of 1, which resumes from that checkpoint and finishes with
    the same global batch and every sample once per epoch (losses against a reference: tests/test_elastic.py).
    """
    from dist_utils import free_port
    from launch_harness import launch_env
    from test_elastic import _check_samples, _kill, _latest_step, _resumed_from, _wait

    out, port = tmp_path / "run", free_port()
    (store_container,) = _objects()["Deployment"]["spec"]["template"]["spec"]["containers"]
    code = store_container["command"][-1].replace(str(store_container["ports"][0]["containerPort"]), str(port))
    env = dict(launch_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", HF_DIST_TEST_STEP_PAUSE="1")  # the SIGTERM mid-run
    store = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    pods = []
    try:
        assert "listening" in store.stdout.readline()
        for name in ("a", "b"):
            log = open(tmp_path / f"{name}.log", "w")
            pods.append(subprocess.Popen(_localhost_pod(port, out), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=ROOT, start_new_session=True))
        a, b = pods
        _wait(lambda: _latest_step(out) >= 2, a, "checkpoint-2")
        b.send_signal(signal.SIGTERM)  # to the shell only, as the kubelet signals PID 1
        assert b.wait(timeout=900) == PREEMPTED_EXIT_CODE, (tmp_path / "b.log").read_text()[-4000:]
        assert a.wait(timeout=900) == 0, (tmp_path / "a.log").read_text()[-4000:]
    finally:
        for proc in pods:
            if proc.poll() is None:
                _kill(proc)
        store.kill()
        store.wait()
    logs = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    checkpoint = _resumed_from((tmp_path / "a.log").read_text(), world=1)
    # both ranks stopped after the same step and saved it (the world's rank 0 says so), and that save was resumed
    assert re.search(rf"preempted \(.*\): saved {checkpoint.name} in .*; exiting with {PREEMPTED_EXIT_CODE}", logs)
    _check_samples(out, None, int(checkpoint.name.split("-")[1]), (2, 1), steps=8)
