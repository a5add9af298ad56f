"""Synthetic merchant-support transcripts: the offline stand-in for the Harbor fine-tuning data.

What it is for: the demo and the tests need conversations that look like support chats between a merchant
and a payments company (refunds, chargebacks, payouts, API keys, shipping labels, disputes, ...) with a
realistic spread of lengths, so that tokenizer training, loss masking and sequence packing see the same
shape of data as the real recipe. Lengths are drawn from log-normal laws (number of exchanges and words per
turn), which gives many short chats and a long tail.

What it is not: a language model or a source of meaningful answers. The text is assembled from phrase banks;
it is fluent enough to train a tokenizer and a tiny model, nothing more.

Everything is driven by one ``random.Random(seed)``: the same seed gives the same conversations and a
byte-identical JSONL file on every machine.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

TOPICS: dict[str, dict[str, list[str]]] = {
    "refunds": {
        "ask": [
            "I need to refund order {order} for {amount} but the button is greyed out.",
            "A customer asked for a partial refund of {amount} on order {order}.",
            "How long does a refund take to reach the card after I issue it?",
            "I refunded order {order} twice by mistake, can you reverse one of them?",
        ],
        "answer": [
            "Refunds go back to the original payment method and usually land in five to ten business days.",
            "You can issue a partial refund from the order page by entering {amount} in the refund field.",
            "The refund button is disabled when the payment is still pending; it unlocks once the charge settles.",
            "I have flagged the duplicate refund on order {order} so the second one is cancelled.",
        ],
    },
    "chargebacks": {
        "ask": [
            "I just got a chargeback notice for {amount} on order {order}, what should I do?",
            "Why was a chargeback fee of {fee} taken from my balance?",
            "The cardholder says they never received the goods, but I have tracking {tracking}.",
        ],
        "answer": [
            "Upload the proof of delivery and the tracking number {tracking} before {date} to contest it.",
            "A chargeback fee of {fee} is charged by the card network and is returned if you win the case.",
            "The bank will review your evidence and decide within sixty to seventy five days.",
        ],
    },
    "payouts": {
        "ask": [
            "My payout of {amount} scheduled for {date} has not arrived yet.",
            "Can I change my payout schedule from weekly to daily?",
            "Why is my payout {amount} lower than my sales this week?",
        ],
        "answer": [
            "Payouts can take up to two business days after {date} to appear in your bank account.",
            "You can switch to daily payouts under Settings, Payouts, Schedule once your account is verified.",
            "Your payout is net of refunds, fees of {fee} and a rolling reserve held for chargebacks.",
        ],
    },
    "api_keys": {
        "ask": [
            "My secret API key stopped working with error {error} this morning.",
            "How do I rotate the API key without taking my checkout down?",
            "Is it safe to put the publishable key in my mobile app?",
        ],
        "answer": [
            "Error {error} means the key was revoked; create a new restricted key in the dashboard.",
            "Create the new key first, deploy it, then roll the old key with an expiry of twenty four hours.",
            "The publishable key is meant for clients, but never ship the secret key in an app.",
        ],
    },
    "shipping_labels": {
        "ask": [
            "The shipping label for order {order} printed with the wrong address.",
            "Can I void a shipping label I bought for {amount} yesterday?",
            "Labels for international orders keep failing with error {error}.",
        ],
        "answer": [
            "Void the label from the order page and buy a new one after you correct the address.",
            "Unused labels can be voided within thirty days and the {amount} is credited to your balance.",
            "Error {error} usually means a customs form is missing the harmonised code for an item.",
        ],
    },
    "disputes": {
        "ask": [
            "A customer opened a dispute for {amount} saying the item was not as described.",
            "How do I respond to dispute {case} before the deadline on {date}?",
            "I lost dispute {case}, can I appeal the decision?",
        ],
        "answer": [
            "Send photos of the item and the listing description, and offer a return if you can.",
            "Open case {case}, click respond, and attach your evidence before {date}.",
            "The issuer's decision on case {case} is final, but you can contact the customer directly.",
        ],
    },
    "account": {
        "ask": [
            "My account was put under review and payments are on hold.",
            "How do I add a second user to my merchant account?",
            "I need to update the bank account that receives my payouts.",
        ],
        "answer": [
            "We need a copy of your business registration to finish the review, usually within two days.",
            "Invite the user from Settings, Team, and choose a role with only the permissions they need.",
            "Add the new bank account, verify the two micro deposits, then set it as the default.",
        ],
    },
}

FILLER_USER = [
    "This is the third time it has happened this month.",
    "I am on the {plan} plan if that matters.",
    "Our store is busy this week so I need this fixed quickly.",
    "I already checked the help center but could not find the answer.",
    "The customer is waiting for a reply from me.",
    "Thanks for looking into it.",
]
FILLER_ASSISTANT = [
    "I can see your account on the {plan} plan.",
    "Thanks for your patience while I checked the logs.",
    "Let me know if anything else looks off.",
    "I have added a note to your account so the next agent has the context.",
    "You will also get an email confirmation with these details.",
    "If it happens again, reply to this thread and we will escalate it.",
]
SYSTEM_PROMPTS = [
    "You are a support agent for a payments platform. Be concise and accurate.",
    "You help merchants with payments, payouts and disputes. Never ask for full card numbers.",
    "You are Harbor, a merchant-support assistant. Answer politely and give the next step.",
]
PLANS = ["Starter", "Growth", "Plus", "Enterprise"]
ERRORS = ["401", "403", "429", "invalid_request", "label_rejected", "api_key_expired"]


@dataclass(kw_only=True, frozen=True)
class LengthProfile:
    """The length laws of the generated conversations (log-normal: many short, a long tail)."""

    exchanges_median: float = 1.5
    """Median number of user/assistant exchanges per conversation."""
    exchanges_sigma: float = 0.6
    """Log-space spread of the number of exchanges."""
    words_median: float = 10.0
    """Median target words per turn (a turn ends at the first sentence that reaches it)."""
    words_sigma: float = 0.7
    """Log-space spread of the words per turn."""
    system_prompt_prob: float = 0.5
    """Probability that a conversation starts with a system prompt."""

    def __post_init__(self) -> None:
        for name in ("exchanges_median", "exchanges_sigma", "words_median", "words_sigma"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LengthProfile.{name}={getattr(self, name)!r} must be > 0")
        if not 0.0 <= self.system_prompt_prob <= 1.0:
            raise ValueError(f"LengthProfile.system_prompt_prob={self.system_prompt_prob!r} must be in [0, 1]")


def _slots(rng: random.Random) -> dict[str, str]:
    """Fresh values for the placeholders of one conversation (order ids, amounts, dates...)."""
    return {
        "order": f"#{rng.randint(10000, 99999)}",
        "amount": f"${rng.randint(5, 2500)}.{rng.randint(0, 99):02d}",
        "fee": f"${rng.choice([15, 20, 25])}.00",
        "tracking": f"1Z{rng.randint(10**9, 10**10 - 1)}",
        "date": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        "case": f"DP-{rng.randint(1000, 9999)}",
        "error": rng.choice(ERRORS),
        "plan": rng.choice(PLANS),
    }


def _turn(rng: random.Random, first: list[str], filler: list[str], slots: dict[str, str], words: int) -> str:
    """One turn: a topical sentence, then topical or filler sentences until about ``words`` words."""
    sentences = [rng.choice(first)]
    count = len(sentences[0].split())
    while count < words:
        pool = first if rng.random() < 0.4 else filler
        sentence = rng.choice(pool)
        sentences.append(sentence)
        count += len(sentence.split())
    return " ".join(sentences).format(**slots)


def generate_conversation(rng: random.Random, profile: LengthProfile = LengthProfile()) -> dict:
    """One conversation ``{"topic": ..., "messages": [{"role", "content"}, ...]}`` drawn from ``rng``."""
    topic = rng.choice(sorted(TOPICS))
    bank = TOPICS[topic]
    slots = _slots(rng)
    exchanges = max(1, round(rng.lognormvariate(math.log(profile.exchanges_median), profile.exchanges_sigma)))
    messages = []
    if rng.random() < profile.system_prompt_prob:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(exchanges):
        turns = (("user", bank["ask"], FILLER_USER), ("assistant", bank["answer"], FILLER_ASSISTANT))
        for role, first, filler in turns:
            words = max(3, round(rng.lognormvariate(math.log(profile.words_median), profile.words_sigma)))
            messages.append({"role": role, "content": _turn(rng, first, filler, slots, words)})
    return {"topic": topic, "messages": messages}


def generate_conversations(n: int, seed: int = 0, profile: LengthProfile = LengthProfile()) -> list[dict]:
    """``n`` conversations from ``seed``; the same arguments give the same list."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a positive integer (the number of conversations to generate)")
    rng = random.Random(seed)
    return [generate_conversation(rng, profile) for _ in range(n)]


def write_jsonl(path: str | Path, n: int, seed: int = 0, profile: LengthProfile = LengthProfile()) -> Path:
    """Write ``n`` conversations from ``seed`` to ``path``, one ``{"messages": [...]}`` object per line.

    The same ``(n, seed, profile)`` gives a byte-identical file. Returns the path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"messages": conv["messages"]}, ensure_ascii=False, separators=(",", ":"))
        for conv in generate_conversations(n, seed, profile)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
