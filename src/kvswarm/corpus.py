"""Real text every machine has, cut into prompts of an exact token length.

Sources: ``pydoc`` (``pydoc_data.topics``: the Python reference's English prose), ``man``
(the troff sources under /usr/share/man, reduced to plain text), ``licenses``
(/usr/share/common-licenses) and ``file:PATH`` (any UTF-8 text file, one item; its seed is
ignored).  A document concatenates source items in an order drawn
from ``seed`` until it has the requested number of tokens, so the same (source, length,
seed) always gives the same token ids.  Tokens that follow the prompt in the same text
are kept as a held-out continuation for teacher-forced quality measurements.
"""

from __future__ import annotations

import gzip
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from kvswarm.errors import BadInput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SOURCES = ("pydoc", "man", "licenses")
MAN_ROOT = Path("/usr/share/man")
LICENSE_ROOT = Path("/usr/share/common-licenses")
DEFAULT_INSTRUCTION = "Read the following text carefully, then summarize it and explain its key points."
_SENTINEL = "\x00KVSWARM-BODY\x00"


@dataclass(frozen=True)
class Document:
    """A prompt of exactly ``len(prompt_ids)`` tokens and the real text that follows it."""

    source: str
    titles: tuple[str, ...]  # the source items the body was cut from, in order
    prompt_ids: tuple[int, ...]
    continuation_ids: tuple[int, ...]  # held-out tokens that follow the body in the source text
    chat: bool

    def __len__(self) -> int:
        return len(self.prompt_ids)


# ---- sources ------------------------------------------------------------------------------
def _pydoc_items() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(f"pydoc:{k}", topics[k].strip()) for k in sorted(topics)]


@cache
def _man_paths() -> tuple[Path, ...]:
    # English pages only (sections man1..man8; translations live in /usr/share/man/<lang>/).  The
    # thousands of generated gcloud pages are left out: near-identical boilerplate would dominate.
    return tuple(sorted(p for sec in MAN_ROOT.glob("man[1-8]") for p in sec.glob("*.gz")
                        if not p.name.startswith("gcloud")))


_TROFF_ESCAPES = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),  # font changes
    (re.compile(r"\\s[+-]?\d+"), ""),  # point-size changes
    (re.compile(r"\\\(em|\\\(en"), "-"),
    (re.compile(r"\\\(bu"), "*"),
    (re.compile(r"\\\((lq|rq|dq)"), '"'),
    (re.compile(r"\\\(..|\\\[[^\]]*\]"), ""),  # other named glyphs
    (re.compile(r"\\[&|^%:]"), ""),  # zero-width escapes
    (re.compile(r"\\[- ~e]"), lambda m: {"\\-": "-", "\\ ": " ", "\\~": " ", "\\e": "\\"}[m.group(0)]),
    (re.compile(r"\\\*\(..|\\\*.|\\n\(..|\\n."), ""),  # strings and number registers
]
_TEXT_MACROS = {"SH", "SS", "B", "I", "BR", "BI", "IB", "IR", "RB", "RI", "IP", "Nm", "Nd", "Sh"}


def man_to_text(troff: str) -> str:
    """Plain text of a man page's troff source: macro lines dropped, their words kept."""
    out = []
    for line in troff.splitlines():
        if line.startswith(('.\\"', "'\\\"", '.\\}')):
            continue
        if line.startswith((".", "'")):
            parts = line[1:].split(None, 1)
            if not parts or parts[0] not in _TEXT_MACROS or len(parts) == 1:
                continue
            line = parts[1].replace('"', "")
            if parts[0] == "IP":  # .IP tag indent: keep the tag only
                line = line.rsplit(None, 1)[0] if " " in line else line
        for pat, rep in _TROFF_ESCAPES:
            line = pat.sub(rep, line)
        out.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def _man_item(path: Path) -> tuple[str, str]:
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        return f"man:{path.name.removesuffix('.gz')}", man_to_text(f.read())


def _license_items() -> list[tuple[str, str]]:
    return [(f"license:{p.name}", p.read_text(errors="replace").strip())
            for p in sorted(LICENSE_ROOT.iterdir()) if p.is_file()]


def available_sources() -> list[str]:
    """The sources this machine has text for."""
    have = ["pydoc"]
    if _man_paths():
        have.append("man")
    if LICENSE_ROOT.is_dir() and any(LICENSE_ROOT.iterdir()):
        have.append("licenses")
    return have


def file_source(path: str | Path) -> str:
    """The source name of a text file (``file:`` + its absolute path), checked to be readable UTF-8."""
    file_text(Path(path))
    return "file:" + str(Path(path).resolve())


def file_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise BadInput(f"text file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise BadInput(f"text file {str(path)!r} is a directory") from None
    except UnicodeDecodeError as e:
        raise BadInput(f"text file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise BadInput(f"text file {str(path)!r} cannot be read: {e.strerror}") from None


def iter_items(source: str, seed: int) -> Iterator[tuple[str, str]]:
    """(title, text) items of ``source`` in an order drawn from ``seed`` (each item once)."""
    rng = random.Random(f"{source}:{seed}")
    if source.startswith("file:"):
        path = Path(source.removeprefix("file:"))
        yield f"file:{path.name}", file_text(path)
    elif source == "pydoc":
        items = _pydoc_items()
        rng.shuffle(items)
        yield from items
    elif source == "licenses":
        items = _license_items()
        rng.shuffle(items)
        yield from items
    elif source == "man":
        paths = list(_man_paths())
        rng.shuffle(paths)  # man pages are read lazily: there are thousands
        for p in paths:
            title, text = _man_item(p)
            if len(text) > 200:
                yield title, text
    else:
        raise BadInput(f"unknown text source {source!r}; one of {SOURCES} or file:PATH")


# ---- documents ----------------------------------------------------------------------------
def chat_frame(tokenizer: PreTrainedTokenizerBase, instruction: str = DEFAULT_INSTRUCTION) -> tuple[list[int], list[int]]:
    """Token ids before and after the document body in a one-turn chat prompt."""
    messages = [{"role": "user", "content": f"{instruction}\n\n{_SENTINEL}"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head, tail = text.split(_SENTINEL)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return enc(head), enc(tail)


def make_document(tokenizer: PreTrainedTokenizerBase, n_tokens: int, seed: int = 0, source: str = "pydoc",
                  chat: bool = False, holdout: int = 0, instruction: str = DEFAULT_INSTRUCTION) -> Document:
    """A prompt of exactly ``n_tokens`` tokens cut from ``source``, plus ``holdout`` following tokens.

    ``chat=True`` wraps the body in the tokenizer's chat template (an instruction to summarize
    it), the way a user would send it; the held-out continuation is then the body's next text.
    """
    head, tail = chat_frame(tokenizer, instruction) if chat else ([], [])
    body_len = n_tokens - len(head) - len(tail)
    if body_len <= 0:
        raise BadInput(f"{n_tokens} tokens cannot hold the chat frame ({len(head) + len(tail)} tokens)")
    need = body_len + holdout
    ids: list[int] = []
    titles = []
    for title, text in iter_items(source, seed):
        ids.extend(tokenizer(("\n\n" if ids else "") + text, add_special_tokens=False)["input_ids"])
        titles.append(title)
        if len(ids) >= need:
            break
    else:
        raise BadInput(f"source {source!r} has only {len(ids)} tokens, {need} requested")
    return Document(source, tuple(titles), tuple(head + ids[:body_len] + tail),
                    tuple(ids[body_len:need]), chat)


def documents(tokenizer: PreTrainedTokenizerBase, n_tokens: int, count: int, seed: int = 0,
              sources: Sequence[str] | None = None, chat: bool = False, holdout: int = 0) -> list[Document]:
    """``count`` documents cycling over ``sources`` (default: all this machine has), seeds seed, seed+1..."""
    srcs = list(sources or available_sources())
    return [make_document(tokenizer, n_tokens, seed + i, srcs[i % len(srcs)], chat, holdout) for i in range(count)]
