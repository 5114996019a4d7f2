"""Verifiable-reward tasks a tiny model can learn on CPU, with a character-level tokenizer.

* ``reverse``: "<s>abc=" -> "cba</s>" over a small alphabet.
* ``add``: "<s>3+4=" -> "7</s>" with small operands.

The reward checks the answer exactly (no learned reward model): the share of answer positions
that hold the right character, over the longer of the answer and the target, so a missing or
extra character costs as much as a wrong one and only the exact answer followed by ``</s>``
scores 1. Partial credit keeps the signal dense enough for a tiny model learning from scratch.

Prompts come from :class:`PromptStream`: a fixed dataset of prompts drawn from a seed, visited in
a per-epoch order drawn by the stream's own generator. Its state (epoch, cursor, generator
state) is plain data, saved in checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import RLHFError
from .limits import MAX_OPERAND, MAX_TASK_LEN

PAD, BOS, EOS = "<pad>", "<s>", "</s>"


class CharTokenizer:
    """One id per character; ids 0, 1, 2 are <pad>, <s>, </s>."""

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise RLHFError(f"tokenizer characters {chars!r} repeat")
        self.vocab = [PAD, BOS, EOS, *chars]
        self.index = {c: i for i, c in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        """Number of ids."""
        return len(self.vocab)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Ids of `text` (with <s> first when `bos`)."""
        try:
            return [self.bos_id] * bos + [self.index[c] for c in text]
        except KeyError as exc:
            raise RLHFError(f"character {exc.args[0]!r} is not in the vocabulary {self.vocab[3:]}") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, stopping at </s>; special tokens other than </s> are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if 3 <= i < len(self.vocab):
                out.append(self.vocab[i])
        return "".join(out)


@dataclass(frozen=True)
class Prompt:
    """One task instance."""

    text: str
    """The prompt text (without <s>)."""
    answer: str
    """The verifiable answer."""


class Task:
    """A verifiable task: prompts, answers, a reward."""

    name = ""
    chars = ""

    def __init__(self, **params: Any):
        self.params = params
        self.tokenizer = CharTokenizer(self.chars)

    def sample(self, rng: np.random.Generator) -> Prompt:  # pragma: no cover - abstract
        raise NotImplementedError

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        """Share of correct answer positions over max(len(answer), len(response)); 0 without </s>."""
        ids = list(response_ids)
        if self.tokenizer.eos_id not in ids:
            return 0.0
        got = self.tokenizer.decode(ids)
        want = prompt.answer
        hits = sum(a == b for a, b in zip(got, want))
        return hits / max(len(got), len(want), 1)

    def max_answer_len(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


class ReverseTask(Task):
    """Reverse a string of `min_len`..`max_len` characters from `alphabet`."""

    name = "reverse"

    def __init__(self, alphabet: str = "abcd", min_len: int = 2, max_len: int = 4):
        if not isinstance(alphabet, str) or not alphabet or "=" in alphabet:
            raise RLHFError(f"reverse task alphabet={alphabet!r:.80}: expected a non-empty string without '='")
        MAX_TASK_LEN.check(len(alphabet), "reverse task len(alphabet)", RLHFError)
        if not _is_int(min_len) or not _is_int(max_len) or not 1 <= min_len <= max_len:
            raise RLHFError(f"reverse task needs ints 1 <= min_len <= max_len, got {min_len!r:.40}, {max_len!r:.40}")
        MAX_TASK_LEN.check(max_len, "reverse task max_len", RLHFError)
        self.chars = alphabet + "="
        super().__init__(alphabet=alphabet, min_len=min_len, max_len=max_len)
        self.alphabet, self.min_len, self.max_len = alphabet, min_len, max_len

    def sample(self, rng: np.random.Generator) -> Prompt:
        n = int(rng.integers(self.min_len, self.max_len + 1))
        s = "".join(self.alphabet[int(i)] for i in rng.integers(0, len(self.alphabet), n))
        return Prompt(s + "=", s[::-1])

    def max_answer_len(self) -> int:
        return self.max_len


class AddTask(Task):
    """a + b for operands 0..`max_operand`."""

    name = "add"
    chars = "0123456789+="

    def __init__(self, max_operand: int = 9):
        if not _is_int(max_operand) or max_operand < 1:
            raise RLHFError(f"add task needs an int max_operand >= 1, got {max_operand!r:.40}")
        MAX_OPERAND.check(max_operand, "add task max_operand", RLHFError)
        super().__init__(max_operand=max_operand)
        self.max_operand = max_operand

    def sample(self, rng: np.random.Generator) -> Prompt:
        a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, 2))
        return Prompt(f"{a}+{b}=", str(a + b))

    def max_answer_len(self) -> int:
        return len(str(2 * self.max_operand))


TASKS = {"reverse": ReverseTask, "add": AddTask}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def make_task(name: str, **params: Any) -> Task:
    """A task by name ("reverse", "add") with its parameters."""
    if not isinstance(name, str) or name not in TASKS:
        raise RLHFError(f"unknown task {name!r:.80}; expected one of {sorted(TASKS)}")
    try:
        return TASKS[name](**params)
    except TypeError as exc:
        raise RLHFError(f"bad parameters for task {name!r}: {exc}") from None


class PromptStream:
    """A fixed dataset of `size` prompts (drawn from `seed`), visited in per-epoch shuffled order."""

    def __init__(self, task: Task, seed: int, size: int = 1024):
        if size < 1:
            raise RLHFError(f"dataset size must be >= 1, got {size}")
        data_rng = np.random.default_rng([seed, 0])
        self.task, self.size = task, size
        self.prompts = [task.sample(data_rng) for _ in range(size)]
        self.rng = np.random.default_rng([seed, 1])  # the sampler's generator: epoch orders
        self.epoch, self.cursor = 0, 0
        self.order = self.rng.permutation(size)

    def next(self, count: int) -> list[tuple[int, Prompt]]:
        """The next `count` (dataset index, prompt) pairs, starting a new epoch when one ends."""
        out = []
        for _ in range(count):
            if self.cursor == self.size:
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self.rng.permutation(self.size)
            i = int(self.order[self.cursor])
            out.append((i, self.prompts[i]))
            self.cursor += 1
        return out

    def state(self) -> dict[str, Any]:
        """Plain-data state (JSON/msgpack-able: the generator's big ints become strings)."""
        return {"epoch": self.epoch, "cursor": self.cursor, "order": self.order.tolist(), "rng": rng_state(self.rng)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what state() returned."""
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.order = np.asarray(state["order"], dtype=np.int64)
        set_rng_state(self.rng, state["rng"])


def rng_state(rng: np.random.Generator) -> dict[str, Any]:
    """A numpy Generator's bit-generator state with ints as strings (msgpack holds 64 bits at most)."""
    return _stringify(rng.bit_generator.state)


def set_rng_state(rng: np.random.Generator, state: dict[str, Any]) -> None:
    """Inverse of rng_state."""
    rng.bit_generator.state = _unstringify(state)


def _stringify(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _stringify(v) for k, v in x.items()}
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return f"int:{int(x)}"
    return x


def _unstringify(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _unstringify(v) for k, v in x.items()}
    if isinstance(x, str) and x.startswith("int:"):
        return int(x[4:])
    return x
