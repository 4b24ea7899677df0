"""The prompt ``kvctl lookup`` and ``kvctl why`` ask about, as token ids.

Two ways in, never both (a usage error, exit 2, one line):

* token ids: on the command line, or ``--file F`` of whitespace-separated integers
  (``-``: stdin);
* text: ``--text "..."`` or ``--text-file F`` (``-``: stdin), tokenized with the
  model's tokenizer. Which tokenizer: ``--model NAME_OR_PATH`` (a Hugging Face id or a
  directory), else the one the namespace names (``NamespaceInfo.tokenizer``: the vLLM
  connector records vLLM's tokenizer with the served model's name), else a usage
  error that says to pass ``--model``.

The ids are the ones an engine computes for the same prompt: a completion's text is
tokenized as vLLM tokenizes a completion prompt (the tokenizer's special tokens added,
e.g. a BOS); ``--chat`` applies the tokenizer's chat template to one user message
with the generation prompt after it, as vLLM builds a chat request's prompt (a chat
request with a system message or several turns is not this prompt: pass its ids).

transformers is imported only here, and only when text is given: kvctl's other
commands start without it. A directory is read with ``local_files_only`` (never the
network); a Hugging Face id is read from the local cache first, and fetched only when
it is not there.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

from kvctl.views import UsageError
from kvproto.v1.results import NamespaceInfo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt's options of ``lookup`` and ``why``."""
    parser.add_argument("tokens", metavar="TOKENS", nargs="*", help="token ids")
    parser.add_argument("--file", "-f", help="file of whitespace-separated token ids ('-': stdin)")
    parser.add_argument("--text", help="the prompt as text, tokenized with the model's tokenizer")
    parser.add_argument(
        "--text-file", metavar="FILE", help="file of the prompt's text ('-': stdin)"
    )
    parser.add_argument(
        "--model",
        metavar="NAME_OR_PATH",
        help="tokenizer for --text: a Hugging Face id or a model directory "
        "(default: the one the namespace names)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="with --text: the text is one user message of a chat request (the "
        "tokenizer's chat template applied, as vLLM does)",
    )


def wants_text(args: argparse.Namespace) -> bool:
    """Whether the prompt is given as text; UsageError for options that do not go
    together."""
    text = args.text is not None or args.text_file is not None
    if text and (args.tokens or args.file is not None):
        raise UsageError("give the prompt as token ids or --text, not both")
    if args.text is not None and args.text_file is not None:
        raise UsageError("give --text or --text-file, not both")
    if not text and (args.chat or args.model):
        raise UsageError("--chat and --model go with --text or --text-file")
    return text


def prompt_tokens(args: argparse.Namespace, info: NamespaceInfo) -> list[int]:
    """The prompt's token ids (text tokenized with the tokenizer ``info`` names or
    ``--model``); UsageError with one line for anything missing or unreadable."""
    if not wants_text(args):
        return token_ids(args.tokens, args.file)
    text = args.text if args.text is not None else read_text(args.text_file)
    if not text:
        raise UsageError("the text is empty")
    source = args.model or info.tokenizer
    if not source:
        raise UsageError(
            f"no tokenizer for namespace {info.ns_id}: it names none (its engine did not "
            "declare one); pass --model NAME_OR_PATH"
        )
    return tokenize(load_tokenizer(source), text, args.chat, source)


def token_ids(words: list[str], path: str | None) -> list[int]:
    """Token ids from argv or from a file (``-``: stdin) of whitespace-separated ints."""
    if path is not None and words:
        raise UsageError("give tokens on the command line or with --file, not both")
    if path is not None:
        words = read_text(path).split()
    if not words:
        raise UsageError("no tokens given")
    try:
        return [int(w) for w in words]
    except ValueError as exc:
        raise UsageError(f"tokens must be integers: {exc}") from None


def read_text(path: str) -> str:
    """A file's text (``-``: stdin), or UsageError naming the file."""
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"cannot read {path}: not UTF-8 text ({exc.reason})") from None


def load_tokenizer(source: str) -> Any:
    """transformers' tokenizer of ``source`` (a directory, or a Hugging Face id: the
    local cache first); UsageError with one line when there is none."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError("--text needs transformers (pip install transformers)") from None
    path = os.path.expanduser(source)
    is_path = os.path.isabs(path) or path.startswith(".") or os.path.exists(path)
    if is_path and not os.path.isdir(path):
        raise UsageError(f"cannot load the tokenizer of {source}: no such directory")
    attempts = [True] if is_path else [True, False]  # a hub id: the cache, then the hub
    error: Exception | None = None
    for local_only in attempts:
        try:
            return AutoTokenizer.from_pretrained(path, local_files_only=local_only)
        except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError and more
            error = exc
    first = " ".join(str(error).split())[:300]
    raise UsageError(f"cannot load the tokenizer of {source}: {first}")


def tokenize(tokenizer: Any, text: str, chat: bool, source: str) -> list[int]:
    """``text``'s ids: as a completion prompt, or (``chat``) as one user message in
    the chat template with the generation prompt after it."""
    if not chat:
        return [int(t) for t in tokenizer(text).input_ids]
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"--chat: the tokenizer of {source} has no chat template")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, Mapping) or hasattr(ids, "keys"):  # transformers 5: a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]
