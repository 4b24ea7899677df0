"""What vLLM's scheduler tells its workers to load and store, step by step (no I/O).

The scheduler side of :class:`kvclient.vllm.KVStoreConnector` keeps one
:class:`RequestState` per request it has seen and turns each scheduler step into a
:class:`StepPlan`: which kvstore blocks each worker copies into which of vLLM's blocks
before the forward pass (:class:`LoadSpec`), and which freshly computed full blocks it
stores after it (:class:`SaveSpec`). Everything here is plain data, picklable, so the
plan crosses to worker processes as vLLM's connector metadata.

Block numbers: kvstore block ``i`` of a prompt is vLLM block ``i`` of the request
(``block_ids[g][i]`` in each KV cache group ``g``): the namespace's ``block_tokens`` is
vLLM's block size. Rules:

1. Full blocks are stored: of the prompt and, unless the connector's
   ``store_replies`` is off, of the reply as it is generated, so that a chat's next
   turn (history + reply + new message) finds the reply too. At most ``(len(prompt) -
   1) // block_size`` blocks are loaded: the engine computes at least the last prompt
   token.
2. A request loads blocks ``local .. hit`` (``local``: blocks vLLM's own prefix cache
   already holds) once, in the step that first schedules it (or resumes it after a
   preemption, when vLLM asks for matches again).
3. After each step, the blocks the step completed (``computed + scheduled`` tokens,
   capped at the tokens known when the step was planned: with async scheduling the
   token a step feeds is sampled after it is planned) and not yet in kvstore are
   stored, in chain order, each after its parent: ``saved`` starts at the blocks
   kvstore already held at lookup time.
4. With early reuse the scheduler claims the blocks it is about to compute; the plan
   carries the claim's ticket so the worker delivers into it (other engines wait for
   those blocks instead of computing them).
5. When a request finishes with computed full blocks not stored yet (the last ones of
   a reply under async scheduling), the next step stores them as a *final* save: vLLM
   keeps the request's blocks until the worker reports the save done
   (``request_finished`` -> True; the worker's ``get_finished`` names the request).
6. A block is stored whole, every group's pages, or not at all: a sliding-window group
   frees the pages behind its window, so a save stops at the first block whose pages a
   group no longer holds (the null block, or freed since the ids were handed out), and
   the request stores nothing after it (a chain has no holes).
7. Every kvstore call on a request's blocks carries its extra keys (its multimodal
   items, LoRA adapter and prompt embeddings: :mod:`kvclient.integrations.vllm.request_keys`);
   a request the connector cannot key (``keys`` None) is neither loaded nor stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvclient.claims import ClaimTicket
from kvclient.integrations.vllm.blocks import NULL_BLOCK
from kvstore.keys import block_extra_key

GroupIds = tuple[list[int], ...]  # vLLM block ids, one list per KV cache group


def own_ids(groups: Sequence[Sequence[int]]) -> GroupIds:
    """A request's own copy of vLLM's block id lists (extended as the request grows)."""
    return tuple(list(group) for group in groups)


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """A request's extra keys: ``common`` mixed into every block, ``per_block`` into
    the prompt blocks they name."""

    common: tuple[bytes, ...] = ()
    per_block: dict[int, tuple[bytes, ...]] = field(default_factory=dict)

    def wire(self, n_blocks: int) -> tuple[bytes, ...]:
        """The extra keys of a kvstore call on the first ``n_blocks`` blocks."""
        own = (block_extra_key(i, parts) for i, parts in self.per_block.items() if i < n_blocks)
        return (*self.common, *own)


TEXT = RequestKeys()  # a request of token ids alone


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy kvstore blocks ``start .. start + len(block_ids)`` of ``tokens`` into
    vLLM's blocks ``block_ids`` before this step's forward pass."""

    req_id: str
    salt: str
    tokens: list[int]  # the prompt up to the end of the last block loaded
    start: int
    block_ids: GroupIds
    extra_keys: tuple[bytes, ...] = ()  # of the request's blocks (rule 7)


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store vLLM's blocks ``block_ids`` as kvstore blocks ``start ..`` of ``tokens``
    after this step's forward pass (into ``claim`` where it covers them)."""

    req_id: str
    salt: str
    tokens: list[int]  # the request's tokens up to the end of the last block stored
    start: int
    block_ids: GroupIds
    claim: ClaimTicket | None = None
    final: bool = False  # the request finished: report it sent once this is done
    extra_keys: tuple[bytes, ...] = ()  # of the request's blocks (rule 7)


@dataclass(slots=True)
class StepPlan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class RequestState:
    """The scheduler's view of one request."""

    salt: str
    prompt: list[int]
    block_size: int
    # what is stored: a live view of prompt + reply (vLLM's ``request.all_token_ids``,
    # which grows as the reply is sampled), or, empty, the prompt alone
    tokens: Sequence[int] = ()
    saved: int = 0  # leading prompt blocks kvstore holds (or this request has stored)
    local: int = 0  # leading blocks vLLM's own cache held when the request was admitted
    load_end: int = 0  # load blocks local .. load_end in the next step that schedules it
    block_ids: GroupIds = ()
    keys: RequestKeys | None = TEXT  # its extra keys; None: not keyable (rule 7)
    claim: ClaimTicket | None = None
    waiting_since: float | None = None  # early reuse: "ask again later" since, without progress
    waited_blocks: int = 0  # early reuse: blocks ready at the last look
    last_lookup: float = 0.0

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = self.prompt

    @property
    def full_blocks(self) -> int:
        return len(self.prompt) // self.block_size

    @property
    def loadable_blocks(self) -> int:
        return max(len(self.prompt) - 1, 0) // self.block_size

    @property
    def asked_blocks(self) -> int:
        """The blocks kvstore is asked for: the loadable ones after those vLLM's own
        prefix cache holds (the denominator of the connector's hit rate)."""
        return max(self.loadable_blocks - self.local, 0)

    def matched(self, local_tokens: int, stored_blocks: int) -> int:
        """Record a lookup (kvstore holds ``stored_blocks`` of the prompt; vLLM's cache
        ``local_tokens``) -> the tokens to load beyond the local hit."""
        self.local = local_tokens // self.block_size
        self.saved = min(stored_blocks, self.full_blocks)
        hit = min(stored_blocks, self.loadable_blocks)
        self.load_end = max(hit, self.local)
        return (self.load_end - self.local) * self.block_size

    def allocated(self, external_tokens: int) -> None:
        """vLLM allocated the request's blocks and will load ``external_tokens``."""
        if external_tokens <= 0:
            self.load_end = self.local
        else:  # (never more than vLLM took)
            self.load_end = min(self.load_end, self.local + external_tokens // self.block_size)

    def take_load(self, req_id: str) -> LoadSpec | None:
        """The load planned for the step that schedules the request (once)."""
        start, end = self.local, self.load_end
        self.load_end = start
        end = min([end, *(len(group) for group in self.block_ids)])  # the blocks vLLM gave
        if end <= start or self.keys is None:
            return None
        tokens = self.prompt[: end * self.block_size]
        ids = tuple(group[start:end] for group in self.block_ids)
        return LoadSpec(req_id, self.salt, tokens, start, ids, self.keys.wire(end))

    def take_save(
        self,
        req_id: str,
        computed_tokens: int,
        block_ids: GroupIds | None = None,
        *,
        first_held: int = 0,
        final: bool = False,
    ) -> SaveSpec | None:
        """The blocks completed once ``computed_tokens`` tokens are computed and not
        stored yet (once each), up to the first that a group no longer holds (rule 6:
        ``first_held`` is the first block every group still holds). ``final``: the
        request finished, and ``block_ids`` are its blocks as vLLM's
        ``request_finished`` names them."""
        if self.keys is None:
            return None
        block_ids = self.block_ids if block_ids is None else block_ids
        done = min(computed_tokens, len(self.tokens)) // self.block_size
        done = min([done, *(len(group) for group in block_ids)])
        if self.saved < first_held:
            done = self.saved  # its pages are gone: nothing more of this request is stored
        for group in block_ids:
            if NULL_BLOCK in group[self.saved : done]:
                done = group.index(NULL_BLOCK, self.saved, done)
        if done <= self.saved:
            return None
        tokens = list(self.tokens[: done * self.block_size])
        ids = own_ids([group[self.saved : done] for group in block_ids])
        extra = self.keys.wire(done)
        spec = SaveSpec(req_id, self.salt, tokens, self.saved, ids, self.claim, final, extra)
        self.saved = done
        return spec
