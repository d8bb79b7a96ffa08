"""Generation with a model in memory: sampling (temperature, top-k, top-p, repetition penalty) and
ids generated one position at a time with a KV cache, under inference mode. Text and chat turns
around it are the commands' (cli/)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .decode import KVPool, decode
from .model import KVCache, MiniMindLM


@dataclass(frozen=True)
class Sampling:
    """How the next id is picked: temperature (0: greedy), top-k (0: all ids), top-p (1: all),
    repetition penalty (1: none)."""

    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float


DEFAULTS = Sampling(temperature=0.7, top_k=0, top_p=0.9, repetition_penalty=1.1)
"""The one set of defaults of `chat` and `generate` (and of generate_ids): a sampling default with
a repetition penalty, so that a small model does not repeat one phrase to the limit as greedy
decoding makes it; `--temperature 0` asks for greedy (the penalty still applies; 1 turns it off).
Deterministic given the seed."""


def sample(logits: torch.Tensor, seen: list[int], temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
           repetition_penalty: float = 1.0, generator: torch.Generator | None = None) -> int:
    """The next id from one position's logits (fp32, 1-D), as sample_rows draws a row: repetition penalty
    on the ids in `seen`, then greedy at temperature 0, else temperature, top-k, top-p and a draw from `generator`."""
    mask = None
    if repetition_penalty != 1.0 and seen:
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        mask[torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)] = True
    return sample_rows(logits[None], [Sampling(temperature, top_k, top_p, repetition_penalty)], [mask], [generator])[0]


def sample_rows(logits: torch.Tensor, samplings: list[Sampling], seen: list[torch.Tensor | None],
                generators: list[torch.Generator | None]) -> list[int]:
    """The next id of each row of `logits` (R, vocab), each row drawn by its own rules: the repetition penalty
    on the ids `seen[r]` marks (a bool row, None: none; as Hugging Face: positive logits divided, negative
    multiplied), then greedy (the first likeliest id) at temperature 0, else temperature, top-k and top-p
    (nucleus) filtering and a draw from `generators[r]`. Every step but the draw is row-wise, so the rows are
    filtered together and a row's bits are the ones it gets alone (tests/test_serve.py holds the
    one-row rule as its referee); the draw stays one multinomial per row, from that row's generator."""
    x, n = logits.float(), logits.shape[0]
    vocab = x.shape[-1]

    def setting(values: list[float]) -> torch.Tensor:
        # Always a tensor of the rows' values, never a Python float when the rows agree: on CUDA a division by a
        # CPU scalar is a multiplication by its inverse (another last bit), so a row's bits would depend on
        # whether its neighbours share its setting. On this CPU both are the same bits (the referee test).
        return torch.tensor(values, dtype=x.dtype, device=x.device)[:, None]

    def rows_of(t: torch.Tensor, at: list[int]) -> torch.Tensor:
        return t if len(at) == t.shape[0] else t[at]

    def put(t: torch.Tensor, at: list[int], new: torch.Tensor) -> torch.Tensor:  # t: a tensor of this function's own
        if len(at) == t.shape[0]:
            return new
        t[at] = new
        return t

    penalised = [r for r in range(n) if samplings[r].repetition_penalty != 1.0 and seen[r] is not None]
    if penalised:
        some, p = rows_of(x, penalised), setting([samplings[r].repetition_penalty for r in penalised])
        marks = torch.stack([seen[r] for r in penalised])
        x = put(x if len(penalised) == n else x.clone(), penalised, torch.where(marks, torch.where(some > 0, some / p, some * p), some))
    out = [0] * n
    greedy = [r for r in range(n) if samplings[r].temperature <= 0]
    if greedy:
        for r, i in zip(greedy, rows_of(x, greedy).argmax(-1).tolist()):
            out[r] = i
    drawn = [r for r in range(n) if samplings[r].temperature > 0]
    if not drawn:
        return out
    x = rows_of(x, drawn) / setting([samplings[r].temperature for r in drawn])  # a tensor of its own from here on
    for k in sorted({samplings[r].top_k for r in drawn if 0 < samplings[r].top_k < vocab}):
        at = [i for i, r in enumerate(drawn) if samplings[r].top_k == k]
        some = rows_of(x, at)
        x = put(x, at, some.masked_fill(some < some.topk(k, -1).values[:, -1:], float("-inf")))
    at = [i for i, r in enumerate(drawn) if samplings[r].top_p < 1.0]
    if at:
        some = rows_of(x, at)
        # A stable sort: tied logits in id order, so the ids kept at the nucleus's edge are the same on any device.
        order = torch.sort(some, dim=-1, descending=True, stable=True).indices
        probs = torch.softmax(some.gather(-1, order), -1)
        drop = probs.cumsum(-1) - probs > setting([samplings[drawn[i]].top_p for i in at])  # the smallest set reaching top_p
        x = put(x, at, some.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf")))
    probs = torch.softmax(x, -1).cpu()
    for i, r in enumerate(drawn):
        out[r] = int(torch.multinomial(probs[i], 1, generator=generators[r]))
    return out


SMALLEST = 1e-6
"""The smallest temperature and repetition penalty a draw takes (and the largest penalty, its inverse): a logit
divided by less can overflow float32 to inf, whose softmax is NaN (a temperature of 0 is greedy)."""


def check_sampling(max_new_tokens: int | None, temperature: float, top_k: int, top_p: float, repetition_penalty: float) -> None:
    """ValueError naming the setting (and its command-line flag) that is outside its range."""
    import math

    problems = []
    if max_new_tokens is not None and max_new_tokens < 0:
        problems.append(f"--tokens must be >= 0, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0 or 0 < temperature < SMALLEST:
        problems.append(f"--temperature must be 0 (greedy) or a finite number >= {SMALLEST:g}, got {temperature}")
    if top_k < 0:
        problems.append(f"--top-k must be >= 0 (0: all ids), got {top_k}")
    if math.isnan(top_p) or not 0 < top_p <= 1:
        problems.append(f"--top-p must be in (0, 1], got {top_p}")
    if not SMALLEST <= repetition_penalty <= 1 / SMALLEST:
        problems.append(f"--repetition-penalty must be from {SMALLEST:g} to {1 / SMALLEST:g} (1: none), got {repetition_penalty}")
    if problems:
        raise ValueError("; ".join(problems))


class Generation:
    """One sequence generated an id at a time: `prompt`, then each `step()` appends the next id
    (None once `eos` came, which is not appended, or `max_new_tokens` are out). `generate_ids` runs
    one to its end; the server (cli/serve.py) steps several together (step_together): their decode
    steps in one batch-invariant forward (model/decode.py), so a reply's ids do not depend on the
    company it is generated in. Under inference mode: no autograd graph is kept, whatever the caller's mode."""

    @torch.inference_mode()
    def __init__(self, model: MiniMindLM, prompt: list[int], max_new_tokens: int | None = None,
                 temperature: float = DEFAULTS.temperature, top_k: int = DEFAULTS.top_k, top_p: float = DEFAULTS.top_p,
                 repetition_penalty: float = DEFAULTS.repetition_penalty, eos: int | None = None,
                 use_cache: bool = True, seed: int = 0, keep_prompt_logits: bool = False, pool: KVPool | None = None) -> None:
        limit = model.cfg.seq_len
        if not prompt:
            raise ValueError("the prompt is empty (at least one id, e.g. BOS)")
        check_sampling(max_new_tokens, temperature, top_k, top_p, repetition_penalty)
        if len(prompt) >= limit:
            raise ValueError(f"the prompt is {len(prompt)} tokens, but the model's context is model.seq_len={limit} positions: "
                             f"shorten it to at most {limit - 1} tokens to generate anything")
        max_new_tokens = limit - len(prompt) if max_new_tokens is None else max_new_tokens
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(f"a prompt of {len(prompt)} tokens and {max_new_tokens} new tokens need {len(prompt) + max_new_tokens} "
                             f"positions, but the rotary tables cover model.seq_len={limit}: ask for at most "
                             f"{max(0, limit - len(prompt))} new tokens")
        self.model, self.eos, self.use_cache, self.left = model, eos, use_cache, max_new_tokens
        self.sampling = Sampling(temperature, top_k, top_p, repetition_penalty)
        self.device = model.tok_embeddings.weight.device
        self.generator = torch.Generator().manual_seed(seed)
        self.ids = list(prompt)
        # a slot of the caller's pool, or of its own of this sequence's positions (not model.seq_len: found by review)
        self.cache = (pool or KVPool(model, 1, len(prompt) + max_new_tokens)).take() if use_cache else None
        self.next_input = torch.tensor([self.ids], dtype=torch.long, device=self.device)  # the prefill's
        self.done = max_new_tokens == 0
        self.finish = "length" if self.done else None  # how it ended: "stop" (EOS came), "length" (no tokens left)
        self.keep_prompt_logits, self.prompt_logits = keep_prompt_logits, None  # the prompt's own (L-1, vocab) logits, once computed
        self.last_id, self.last_logits = None, None  # the id the last step drew (EOS too) and the logits it drew it from
        self.seen_ids: torch.Tensor | None = None  # the ids so far as a bool row, for the penalty (seen())
        self.closed = False  # close() gave the slot back

    @torch.inference_mode()
    def step(self) -> int | None:
        """The next id, appended to `ids`; None when the sequence has ended (EOS or the limit). The
        sequence alone: its prompt's forward (the prefill) first, then model.decode.decode over a batch
        of one, the very arithmetic it gets in a batch (step_together)."""
        self.last_id = None
        if self.done:
            return None
        self.check_open()
        if self.use_cache and self.cache.length:
            return self.take(decode(self.model, [self.ids[-1]], [self.cache])[0])
        if self.use_cache:
            logits, _ = self.model(self.next_input, cache=self.cache)
        else:
            logits, _ = self.model(torch.tensor([self.ids], dtype=torch.long, device=self.device))
        if self.keep_prompt_logits and self.prompt_logits is None:
            self.prompt_logits = logits[0, :len(self.ids) - 1] if self.use_cache else logits[0, :-1]
        return self.take(logits[0, -1])

    def take(self, logits: torch.Tensor) -> int | None:
        """Draw the next id from this position's logits (1-D) with this sequence's sampling and generator."""
        return take_together([self], logits[None])[0]

    def seen(self, vocab: int) -> torch.Tensor | None:
        """The ids so far as a bool row of `vocab` (kept up to date by `took`), None without a penalty."""
        if self.sampling.repetition_penalty == 1.0:
            return None
        if self.seen_ids is None:
            self.seen_ids = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            self.seen_ids[torch.tensor(self.ids, dtype=torch.long, device=self.device)] = True
        return self.seen_ids

    def took(self, nxt: int) -> int | None:
        """Record the id drawn: the end at EOS (not appended) or at the limit."""
        self.last_id = nxt
        self.left -= 1
        if nxt == self.eos:
            self.done, self.finish = True, "stop"
            return None
        self.ids.append(nxt)
        if self.seen_ids is not None:
            self.seen_ids[nxt] = True
        self.done = self.left == 0
        self.finish = "length" if self.done else None
        return nxt

    def close(self) -> None:
        """Give the cache's slot back to its pool (a server's sequence that ended); no step after."""
        if self.cache is not None and self.cache.pool is not None:
            self.cache.pool.release(self.cache)
        self.closed = True

    def check_open(self) -> None:
        """A step after close() is refused: its slot may be another sequence's now, whose keys and values its
        prefill would overwrite (found by review)."""
        if self.closed:
            raise RuntimeError("this generation was closed: its KV slot went back to the pool, so it cannot step again")


def take_together(gens: list[Generation], logits: torch.Tensor) -> list[int | None]:
    """Each sequence's take() of its row of `logits` (R, vocab), the rows filtered together (sample_rows: each
    row's draw the one it gets alone, from its own generator)."""
    logits = logits.float()
    for g, row in zip(gens, logits):
        g.last_logits = row
    drawn = sample_rows(logits, [g.sampling for g in gens], [g.seen(logits.shape[-1]) for g in gens], [g.generator for g in gens])
    return [g.took(nxt) for g, nxt in zip(gens, drawn)]


@torch.inference_mode()
def step_together(gens: list[Generation]) -> list[int | None]:
    """Each sequence's step() as it would be alone, the ones past their prefill decoded in one forward
    (model.decode: batch-invariant, so each row is the bits it gets alone) and their next ids drawn together
    (take_together); a fresh one's prefill runs alone."""
    out: dict[int, int | None] = {}
    for g in gens:  # before any of them steps
        if not g.done:
            g.check_open()
    batch = [k for k, g in enumerate(gens) if not g.done and g.use_cache and g.cache.length]
    for k, g in enumerate(gens):
        if k not in batch:
            out[k] = g.step()
    pools: dict[int, list[int]] = {}
    for k in batch:  # one forward per pool (a server's sequences share one; generations of their own each have theirs)
        pools.setdefault(id(gens[k].cache.pool), []).append(k)
    for group in pools.values():
        rows = decode(gens[group[0]].model, [gens[k].ids[-1] for k in group], [gens[k].cache for k in group])
        for k in group:
            gens[k].last_id = None
        for k, nxt in zip(group, take_together([gens[k] for k in group], rows)):
            out[k] = nxt
    return [out[k] for k in range(len(gens))]


def generate_ids(model: MiniMindLM, prompt: list[int], max_new_tokens: int | None = None,
                 temperature: float = DEFAULTS.temperature, top_k: int = DEFAULTS.top_k, top_p: float = DEFAULTS.top_p,
                 repetition_penalty: float = DEFAULTS.repetition_penalty, eos: int | None = None,
                 use_cache: bool = True, seed: int = 0) -> list[int]:
    """`prompt` and up to `max_new_tokens` generated ids (default: up to model.seq_len positions),
    ending early at `eos` (not included). With `use_cache`, each new id costs one position's forward
    over the keys and values kept from before; without, the whole sequence is recomputed every time.
    Under inference mode (Generation)."""
    gen = Generation(model, prompt, max_new_tokens, temperature, top_k, top_p, repetition_penalty, eos, use_cache, seed)
    while gen.step() is not None:
        pass
    return gen.ids


@torch.inference_mode()
def generate_group(model: MiniMindLM, prompt: list[int], generators: list[torch.Generator], max_new_tokens: int,
                   temperature: float = 0.8, top_p: float = 1.0, use_cache: bool = True) -> torch.Tensor:
    """One prompt's group of completions (one per generator), generated together as one fixed-shape
    unit: a batch of len(generators) copies of the prompt, `max_new_tokens` positions each (no early
    stop: what follows an EOS is generated and left to the caller's mask), each row's next id drawn
    from its own generator. The same prompt, weights and generators give the same ids on any rank
    and in any company: nothing depends on other prompts or on who computes. (n, max_new_tokens) ids."""
    n, device = len(generators), model.tok_embeddings.weight.device
    if len(prompt) + max_new_tokens > model.cfg.seq_len:
        raise ValueError(f"a prompt of {len(prompt)} tokens and {max_new_tokens} new tokens exceed model.seq_len={model.cfg.seq_len}")
    cache = KVCache(model, n, len(prompt) + max_new_tokens) if use_cache else None
    seq = torch.tensor([prompt] * n, dtype=torch.long, device=device)
    step = seq
    out = torch.empty(n, max_new_tokens, dtype=torch.long)
    for t in range(max_new_tokens):
        logits, _ = model(step, cache=cache) if use_cache else model(seq)
        last = logits[:, -1].float()
        nxt = sample_rows(last, [Sampling(temperature, 0, top_p, 1.0)] * n, [None] * n, generators)
        out[:, t] = torch.tensor(nxt)
        step = out[:, t:t + 1].to(device)
        seq = torch.cat([seq, step], dim=1)
    return out
