"""What a resume must keep (else it is refused, naming each) and what it may change (with a
warning that says what the change costs), as dotted paths into a checkpoint's manifest
(checkpoint/manager.py: RunMeta) with the name users know."""
from __future__ import annotations

from dataclasses import asdict

from model.config import RopeScaling

MUST_MATCH = {
    "config.seed": "seed", "global_batch": "train.global_batch",
    **{f"data_fingerprint.{k}": f"data {k}" for k in ("source_sha256", "files", "tokenizer", "seq_len", "num_samples", "options")},
    "data_fingerprint.order": "data.order",
    # The adapters' shape and scale: another would be another model over the same base (docs/lora.md).
    **{f"config.train.lora.{k}": f"train.lora.{k}" for k in ("rank", "alpha", "targets")},
    "config.train.objective": "train.objective",
    # A rollout's shape and what it serves: another would be another step (docs/rl.md).
    **{f"config.train.grpo.{k}": f"train.grpo.{k}" for k in ("generations", "updates_per_rollout", "loss", "reward")},
}
_DIFFERS = "the optimization from here on differs from the uninterrupted run"
MAY_CHANGE = {
    "config.train.steps": ("train.steps", "the LR schedule from here on spans the new count"),
    "config.train.dtype": ("train.dtype", "autocast changes the arithmetic: not bit-identical to the uninterrupted run"),
    "config.train.compile": ("train.compile", "compiled kernels round otherwise than eager ones: from here on not bit-identical "
                             "to the uninterrupted run"),
    **{f"config.train.{k}": (f"train.{k}", _DIFFERS)
       for k in ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip")},
    "micro_batch": ("train.micro_batch", "each step's gradient is summed over other micro-batches: not bit-identical to the "
                    "uninterrupted run (and for an MoE model, whose load-balancing loss is a micro-batch's, another objective)"),
    "threads": ("intra-op threads per process", "floating-point results differ, so bit-equality with an uninterrupted run is not promised"),
    "config.dist.reduce": ("dist.reduce", "the gradients are summed in another order: not bit-identical to the uninterrupted run"),
    "strategy": ("dist.strategy", "the checkpoint's states are loaded exactly (DCP reshards them); the gradients are reduced by "
                 "the other strategy's reduction from here on, which gives the uninterrupted run's bits under dist.reduce=canonical "
                 "only"),
    "config.train.lora.dropout": ("train.lora.dropout", _DIFFERS),
    **{f"config.train.{k}": (f"train.{k}", _DIFFERS) for k in ("dpo.beta", "grpo.temperature", "grpo.top_p", "grpo.max_new_tokens",
                                                              "grpo.beta", "grpo.eps", "grpo.eps_high")},
    **{f"config.train.distill.{k}": (f"train.distill.{k}", _DIFFERS) for k in ("alpha", "temperature")},
    "config.train.distill.top_k": ("train.distill.top_k", "the KL runs over another part of the teacher's distribution from here "
                                   "on (0 and the vocabulary size are the same bits: docs/distill.md)"),
    "config.train.dpo.precompute": ("train.dpo.precompute", "the reference's log-probabilities are the same bits live and "
                                    "precomputed (tests/test_dpo.py): the run goes on as the uninterrupted one"),
    "config.runtime.deterministic": ("runtime.deterministic", "other kernels may run: bit-equality with the uninterrupted run is not promised"),
}


def policy(model_keys, repack: bool = False) -> tuple[dict, dict]:
    """(must_match, may_change) of a run whose model config has `model_keys`: every model key must
    match, but model.init_from, which names where a run began (a resume continues it whatever the
    key says now); model.seq_len and the packing at it may change under data.resume_seq_len=repack
    (`repack`: a new phase, data/repack.py)."""
    must = MUST_MATCH | {f"config.model.{k}": (f"model.{k}", NEWER[k]) if k in NEWER else f"model.{k}"
                         for k in model_keys if k != "init_from"}
    must["config.model.seq_len"] = "model.seq_len (data.resume_seq_len=repack continues at another: docs/data.md)"
    if not repack:
        return must, MAY_CHANGE
    for k in ("config.model.seq_len", "data_fingerprint.seq_len", "data_fingerprint.num_samples"):  # the packing follows seq_len
        must.pop(k)
    must |= {f"config.data.{k}": f"data.{k} (data.resume_seq_len=repack changes the packing's length, not its count)"
             for k in ("num_samples", "val_samples")}
    return must, MAY_CHANGE | {"config.model.seq_len": ("model.seq_len", REPACKED)}


REPACKED = ("data.resume_seq_len=repack: the rest of the epoch is repacked at the new length, the corpus from the next epoch on "
            "(a new phase: bit-identical to a run that made the same change at the same step)")


NEWER = {"rope_scaling": asdict(RopeScaling())}
"""Model keys newer than some checkpoints, with what a checkpoint without one ran: plain RoPE before
model.rope_scaling (checkpoint format 2's runs resume; tests/test_checkpoint_format.py)."""
