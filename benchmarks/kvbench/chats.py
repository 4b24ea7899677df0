"""Multi-turn chats over real English text, for the tests and benchmarks that run a
real chat model (:mod:`kvclient.smollm2`).

Each conversation has a long system document of its own: a license text that Debian
systems ship (``/usr/share/common-licenses``), or, where those are missing, slices of
this repository's own LICENSE. A turn's prompt is the whole conversation so far in the
model's chat template: system document, earlier questions and replies, the new
question. The prompt is rendered as text and tokenized as a client of an OpenAI-style
server would have it done, so a turn's prompt holds the previous reply as text: the
reply's tokens come back as the model generated them (greedy replies are canonical
tokenizations) except at rare seams, which the benchmark's cached share shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LICENSES = Path("/usr/share/common-licenses")
OWN_LICENSE = Path(__file__).resolve().parents[2] / "LICENSE"
# distinct texts (GPL, LGPL and GFDL are links to versions listed here)
DOCUMENTS = (
    "Apache-2.0", "GPL-3", "MPL-2.0", "GFDL-1.3", "LGPL-2.1", "GPL-2", "MPL-1.1",
    "Artistic", "CC0-1.0", "GFDL-1.2", "GPL-1", "LGPL-2",
)  # fmt: skip
QUESTIONS = (
    "What is this document about, in two sentences?",
    "Who has to follow it, and when?",
    "Which conditions matter most for a company shipping software?",
    "What does it say about warranties?",
    "Summarise our conversation in one sentence.",
)
SYSTEM = "Answer questions about the document below, briefly and precisely.\n\n"


def document_texts(count: int) -> list[str]:
    """``count`` distinct long English texts."""
    texts = [(LICENSES / name).read_text() for name in DOCUMENTS if (LICENSES / name).is_file()]
    if len(texts) < count:  # not a Debian system: slices of our own LICENSE
        own = OWN_LICENSE.read_text()
        step = max(len(own) // max(count, 1), 1)
        texts = [own[i * step :] + own[: i * step] for i in range(count)]
    return texts[:count]


@dataclass
class Chat:
    """One conversation: its messages so far."""

    messages: list[dict[str, str]] = field(default_factory=list)

    def ask(self, question: str) -> list[dict[str, str]]:
        self.messages.append({"role": "user", "content": question})
        return list(self.messages)

    def answer(self, reply: str) -> None:
        self.messages.append({"role": "assistant", "content": reply})


def make_chats(tokenizer: Any, count: int, doc_tokens: int) -> list[Chat]:
    """``count`` chats, each with a system document cut to about ``doc_tokens`` tokens."""
    chats = []
    for text in document_texts(count):
        ids = tokenizer.encode(text, add_special_tokens=False)[:doc_tokens]
        document = tokenizer.decode(ids)
        chats.append(Chat([{"role": "system", "content": SYSTEM + document}]))
    return chats


def prompt_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt of ``messages`` as the server would make it: the chat template as
    text, then tokenized (the template carries its special tokens)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))
