"""Deliberate breaks of the core promises, one at a time, each caught by a test (docs/design.md I21).

    bash scripts/mutants.sh [--list | --markdown] [--only NAME ...] [--no-baseline]

The repository is copied (tracked and untracked, not ignored, files) into a temporary folder.
First the tests named below run there unmutated: they must pass, or a "caught" would mean nothing.
Then each mutant replaces one exact piece of text in one file (it must occur exactly once, else
the mutant no longer fits the code and the script fails), the tests named for it run with `-x`,
and the file is put back. One line per mutant: `caught by <test>` or `SURVIVED`. Exit 0 only when
every mutant is caught; 1 when one survived; 2 when a mutant no longer applies, the baseline fails or
skips a test, or a mutant's tests were skipped (a skip proves nothing).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    promise: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


EVAL_IDENTICAL = ("tests/test_eval.py::test_a_run_scoring_eval_tasks_logs_them_and_ends_bit_identical_to_the_run_without_weights_losses_"
                  "and_generators")
FAMILY_REFEREE = "tests/test_grpo_family.py::test_each_loss_equals_trls_compute_loss_on_a_fixed_batch"
FAMILY_CHAIN = "tests/test_grpo_family.py::test_a_variant_halted_inside_a_rollouts_updates_on_2_resumed_on_3_equals_the_1_process_run"
PPO_REFEREE = "tests/test_ppo.py::test_gae_whitening_policy_kl_value_and_approx_kl_equal_minimind_train_ppo_on_one_batch"
PPO_CHAIN = "tests/test_ppo.py::test_ppo_halted_inside_a_rollouts_updates_on_2_resumed_on_3_equals_the_1_process_run"
GRPO_CHAIN = "tests/test_grpo.py::test_halted_inside_a_rollouts_updates_on_2_resumed_on_3_then_on_1_equals_the_uninterrupted_run"
AGENT_CHAIN = "tests/test_agent.py::test_agent_halted_inside_a_rollouts_updates_on_2_resumed_on_3_then_on_1_equals_the_uninterrupted_run"

MUTANTS = (
    Mutant("fsdp-load-in-dict-order", "every rank hands FSDP's full-state load its tensors in the model's order (I19)",
           "runtime/sharding.py", "    set_model_state_dict(model, ordered, options=", "    set_model_state_dict(model, full_state, options=",
           ("tests/test_sharding.py::test_load_full_hands_the_tensors_over_in_the_models_order_whatever_the_dicts_order",)),
    Mutant("rng-not-restored", "every rank's global RNG state is restored on resume (I6)",
           "checkpoint/manager.py", "            rng.restore_blob(target[\"rng\"][str(self.comm.rank)], self.comm.device)\n", "            pass\n",
           ("tests/test_checkpoint_manager.py::test_load_restores_the_global_generators_each_rank_had_at_the_save",)),
    Mutant("optimizer-not-restored", "the optimizer state is restored on resume (I23)",
           "checkpoint/manager.py", "                obj.load_state_dict(target[name])\n",
           "                obj.load_state_dict(target[name]) if name != 'optimizer' else None\n",
           ("tests/test_checkpoint_manager.py::test_load_restores_the_optimizers_state_and_param_groups_exactly",
            "tests/test_resume_e2e.py::test_a_run_halted_twice_in_process_equals_the_uninterrupted_one")),
    Mutant("optimizer-target-not-adams", "a resume's optimizer state is made as Adam's first step makes it, without the step (I23)",
           "checkpoint/states.py", 'else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"))', 'else torch.tensor(0, device="cpu"))',
           ("tests/test_checkpoint_manager.py::test_a_fresh_adams_load_target_is_the_state_its_first_step_makes_without_the_step",)),
    Mutant("optimizer-unstepped-saved-stepped", "an optimizer saved before its first step (a stop in the first rollout) resumes unstepped (I23)",
           "checkpoint/states.py", "            _fresh_adam_state(self.optimizer, torch.zeros_like)\n", "            pass\n",
           ("tests/test_checkpoint_manager.py::test_an_optimizer_saved_before_its_first_step_resumes_to_take_that_step_as_a_fresh_one",)),
    Mutant("optimizer-names-stale", "a save's optimizer state is DCP's own dict, its names reused only while the parameters are the same (I23)",
           "checkpoint/states.py", "if self.optimizer.state and self._names and self._names[0] == ids:",
           "if self.optimizer.state and self._names:",
           ("tests/test_checkpoint_manager.py::test_the_states_reused_names_give_dcps_own_dicts_while_the_module_and_parameters_stay_and_after_they_change",)),
    Mutant("skip-off-by-one", "a resume skips exactly what the epoch consumed (I2, I4)",
           "data/loader.py", "SkipBatchSampler(sampler, first * plan.accum)", "SkipBatchSampler(sampler, first * plan.accum + (1 if first else 0))",
           ("tests/test_resume_e2e.py::test_a_run_halted_twice_in_process_equals_the_uninterrupted_one",)),
    Mutant("epoch-seed-without-epoch", "epoch e's order is randperm seeded with seed + e (I1)",
           "data/sampler.py", "g.manual_seed(seed + epoch)", "g.manual_seed(seed)",
           ("tests/test_sampler.py::test_the_epoch_order_is_distributed_samplers_permutation",
            "tests/test_sampler.py::test_same_seed_and_epoch_give_the_same_order_another_epoch_another")),
    Mutant("rescale-ignored", "the skip is rescaled to the new world size (I4)",
           "data/loader.py", "SkipBatchSampler(sampler, first * plan.accum)", "SkipBatchSampler(sampler, first * plan.micro_batches)",
           ("tests/test_resume_e2e.py::test_world_size_two_to_one_to_two_is_sample_exact_and_close_in_weights",)),
    Mutant("sha256-not-checked-on-load", "a state file is used only if its sha256 is the manifest's (I8, I10)",
           "checkpoint/files.py", "    if sha != entry[\"sha256\"]:\n", "    if False:\n",
           ("tests/test_checkpoint_io.py::test_a_flipped_byte_inside_a_tensor_is_refused_by_the_verified_load",
            "tests/test_sharding.py::test_a_flipped_byte_in_one_shard_falls_back_to_the_previous_checkpoint",
            "tests/test_checkpoint_format.py::test_a_format_2_checkpoint_with_a_flipped_byte_falls_back_to_the_previous_one_and_the_run_still_ends_"
            "on_the_same_bits")),
    Mutant("no-fallback", "a damaged newest checkpoint falls back to the newest that verifies (I13)",
           "checkpoint/manager.py", "            faults.append(why)\n", "            raise storage.CheckpointError(why)\n",
           ("tests/test_checkpoint_manager.py::test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one",)),
    Mutant("canonical-in-rank-order", "canonical sums micro-batch gradients in micro-batch order, whatever W",
           "runtime/reduce.py", "rows = self.gathered.view(w, self.accum, -1).transpose(0, 1).reshape(w * self.accum, -1)",
           "rows = self.gathered",
           ("tests/test_canonical_e2e.py::test_three_then_one_then_two_processes_compute_the_bits_of_one_process_at_every_step",)),
    Mutant("dropout-seed-by-rank", "in-step randomness follows the micro-batch, not the rank (I6)",
           "train.py", "i = reducer.index(j)  #", "i = j  #",
           ("tests/test_canonical_e2e.py::test_three_then_one_then_two_processes_compute_the_bits_of_one_process_at_every_step",)),
    Mutant("lock-not-taken", "one run per folder: rank 0 holds an OS lock on out_dir (I12)",
           "run/folder.py", "            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n            break\n",
           "            break\n",
           ("tests/test_run_folder.py::test_a_folder_locked_by_another_process_is_refused_naming_it",)),
    Mutant("prune-unverified", "pruning deletes only checkpoints this run verified or wrote (I13)",
           "checkpoint/storage.py", "        if p not in owned:\n", "        if False:\n",
           ("tests/test_checkpoint_io.py::test_pruning_never_counts_or_deletes_a_checkpoint_that_does_not_verify_nor_follows_a_link",)),
    Mutant("metrics-not-truncated", "metrics lines past the resumed step are dropped (I11)",
           "train.py", "        truncate(out / folder.METRICS, start, ", "        (lambda *a, **k: 0)(out / folder.METRICS, start, ",
           ("tests/test_resume_e2e.py::test_a_resume_drops_the_metrics_lines_a_killed_run_logged_past_its_checkpoint",)),
    Mutant("lr-from-the-launch", "the LR is a pure function of the optimizer step (I5)",
           "train.py", "lr = lr_at(step, cfg.train)", "lr = lr_at(step - start, cfg.train)",
           ("tests/test_resume_e2e.py::test_a_run_halted_twice_in_process_equals_the_uninterrupted_one",)),
    Mutant("stop-raises-after-settled", "a stop signal after the run's outcome is decided only sets the flag: no traceback under the one error line (I9)",
           "run/stop.py", "        self.setup = self.interrupt = False\n", "        pass\n",
           ("tests/test_protocol.py::test_a_stop_signal_after_the_outcome_is_settled_only_sets_the_flag_where_in_set_up_it_raises",)),
    Mutant("prune-manifest-first-in-trash", "a pruned checkpoint's deletion, done after the save returns, is finished by the next start when cut short, nothing set aside (I8)",
           "checkpoint/storage.py", "    last = folder.name.startswith(_TRASH_PREFIX)\n", "    last = False\n",
           ("tests/test_checkpoint_io.py::test_a_pruned_checkpoint_leaves_its_name_at_once_and_a_deletion_cut_short_is_finished_at_the_next_start",)),
    Mutant("stop-not-agreed", "a stop is decided by every rank's vote, not the local flag (I9)",
           "run/protocol.py", "        return stops > 0\n", "        return stop\n",
           ("tests/test_protocol.py::test_a_boundary_raises_the_other_ranks_failure_on_this_rank_and_a_stop_vote_stops_both",)),
    Mutant("failure-not-agreed", "a rank's failure is raised on every rank at the boundary (I9, I24)",
           "run/protocol.py", "        if failures:\n            self.agree", "        if error is not None:\n            self.agree",
           ("tests/test_protocol.py::test_a_boundary_raises_the_other_ranks_failure_on_this_rank_and_a_stop_vote_stops_both",)),
    Mutant("pack-failure-not-agreed", "a packer's failure fails every rank, naming it (I22, I24)",
           "data/run.py", "    for r, outcome in outcomes.items():\n        if \"error\" in outcome:",
           "    for r, outcome in outcomes.items():\n        if False:",
           ("tests/test_protocol.py::test_a_corpus_that_fails_to_tokenize_on_the_packer_ends_every_rank_with_2_naming_the_file_and_line",)),
    Mutant("exit-code-table-changed", "one table decides every exit code (I16, I24)",
           "common/outcome.py", '    "stopped": 75,', '    "stopped": 1,',
           ("tests/test_protocol.py::test_one_function_maps_every_ending_to_its_code",)),
    Mutant("scaler-not-saved", "the float16 GradScaler's state is part of the checkpoint (I23)",
           "train.py", '**({"scaler": self.scaler} if self.scaler else {})', "**{}",
           ("tests/test_dtypes_and_devices.py::test_mixed_precision_resumes_bit_identically_with_the_scalers_state",)),
    Mutant("corpus-not-compared", "a resume under another corpus is refused (I20)",
           "configs/resume.py", 'for k in ("source_sha256", "files", "tokenizer",', 'for k in ("files", "tokenizer",',
           ("tests/test_checkpoint_safety.py::test_a_changed_corpus_is_an_error_naming_the_data_fingerprint",)),
    Mutant("tokenizer-not-in-fingerprint", "a resume under another tokenizer is refused, naming both (I14)",
           "configs/resume.py", '"files", "tokenizer", "seq_len"', '"files", "seq_len"',
           ("tests/test_tokenizers.py::test_a_resume_with_another_tokenizer_fails_naming_both_and_generate_uses_the_checkpoints_own",)),
    Mutant("global-batch-accepted", "the global batch is fixed for a run (I3)",
           "configs/resume.py", '"global_batch": "train.global_batch",', "",
           ("tests/test_checkpoint_safety.py::test_a_resume_under_another_model_corpus_batch_or_seed_is_an_error_naming_the_field",)),
    Mutant("pickle-allowed", "loading never runs pickled code (I10)",
           "checkpoint/format.py", 'return torch.load(data, map_location="cpu", weights_only=True)',
           'return torch.load(data, map_location="cpu", weights_only=False)',
           ("tests/test_checkpoint_safety.py::test_a_checkpoint_carrying_pickled_code_is_refused_and_the_code_never_runs",)),
    Mutant("resume-never-overwrites", "resume=never refuses a folder that holds checkpoints (I13)",
           "checkpoint/manager.py", "            if existing:\n                raise", "            if False:\n                raise",
           ("tests/test_checkpoint_manager.py::test_resume_never_over_checkpoints_is_refused_and_auto_over_only_damaged_ones_stops",)),
    Mutant("files-out-of-name-order", "a directory is read in name order, as its files concatenated (I20)",
           "data/sources.py", "files = sorted(p for p in path.resolve().iterdir() if not p.name.startswith(\".\"))",
           "files = sorted((p for p in path.resolve().iterdir() if not p.name.startswith(\".\")), reverse=True)",
           ("tests/test_corpora.py::test_a_directory_and_a_glob_train_bit_identically_to_their_files_concatenated_in_name_order",)),
    Mutant("file-not-named-on-resume", "a resume under a changed corpus file names the file (I20)",
           "configs/resume.py", '("source_sha256", "files", "tokenizer"', '("source_sha256", "tokenizer"',
           ("tests/test_corpora.py::test_each_file_of_a_corpus_is_in_the_fingerprint_and_a_resume_refuses_a_change_naming_the_file",)),
    Mutant("verify-full-ignored", "data.verify_source=full hashes the files again (I20)",
           "data/prepare.py", 'if verify == "full" or not _trusted(record, identity):', "if not _trusted(record, identity):",
           ("tests/test_corpora.py::test_a_second_launch_trusts_the_files_identity_and_verify_source_full_reads_them_again",)),
    Mutant("racy-mtime-trusted", "a file modified within the mtime tick of its hashing is hashed again (I20)",
           "data/prepare.py", 'identity["mtime_ns"] < record.get("checked_ns", 0) - RACY_NS', "True",
           ("tests/test_corpora.py::test_a_file_modified_just_before_it_was_hashed_is_hashed_again",)),
    Mutant("change-while-packing-unseen", "a file that changes while it is packed is refused (I20)",
           "data/sources.py", "            if changed:", "            if False:",
           ("tests/test_corpora.py::test_a_file_that_changes_while_it_is_packed_is_refused_and_nothing_is_cached",)),
    Mutant("wait-bounded-by-time", "waiters wait as long as the packer's heartbeat moves (I22)",
           "runtime/board.py", 'last_beat, last_change = record.get("beat"), now', 'last_beat = record.get("beat")',
           ("tests/test_corpora.py::test_waiters_get_the_packers_outcome_and_fail_at_once_when_it_fails_or_stops_beating",
            "tests/test_corpora.py::test_a_pack_longer_than_the_collective_timeout_succeeds_on_two_processes")),
    Mutant("bijective-without-cycle-walk", "the bijective order is a permutation of [0, N) for every N (I1)",
           "data/sampler.py", "        while (out := y >= np.uint64(self.n)).any():\n            y[out] = self._permute(y[out])\n",
           "        y = y % np.uint64(self.n)\n",
           ("tests/test_corpora.py::test_the_bijective_order_is_a_permutation_for_any_n",)),
    Mutant("bijective-key-without-epoch", "the bijective order is keyed by seed + epoch (I1)",
           "data/sampler.py", "BijectiveOrder)(num_samples, seed + epoch)", "BijectiveOrder)(num_samples, seed + (epoch if kind == 'randperm' else 0))",
           ("tests/test_corpora.py::test_the_bijective_order_is_keyed_by_seed_plus_epoch_and_pinned_across_releases",)),
    Mutant("loss-mean-of-means", "a chat step's loss is over the taught tokens of the global batch (I17)",
           "objectives/next_token.py",
           'logits, loss = net(x, y, positions=batch[2].to(device, non_blocking=True), reduction="sum")\n            loss = loss * self.micro_batches / self.taught',
           "logits, loss = net(x, y, positions=batch[2].to(device, non_blocking=True))",
           ("tests/test_chat.py::test_the_steps_loss_is_over_the_taught_tokens_of_the_global_batch_whatever_the_micro_batch",)),
    Mutant("mask-from-the-opener", "the loss starts after <bos>assistant\\n, not at it (I17)",
           "data/chat.py", "        start = at + len(opener)\n", "        start = at\n",
           ("tests/test_chat.py::test_only_assistant_turns_teach_from_after_the_opener_through_im_end_and_its_newline",)),
    Mutant("cross-talk", "packed conversations do not attend to each other (docs/sft.md) (I18)",
           "model/model.py", "mask = ((seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal).unsqueeze(1)",
           "mask = causal.expand(seg.shape[0], t, t).unsqueeze(1)",
           ("tests/test_chat.py::test_a_conversations_logits_inside_a_pack_equal_its_logits_alone",)),
    Mutant("html-escaping-tojson", "templates render as transformers renders them (I18)",
           "data/chat.py", '    env.filters["tojson"] = tojson\n', "",
           ("tests/test_chat.py::test_the_ids_are_transformers_apply_chat_template_tokenized_with_minimind_and_a_trained_tokenizer",)),
    Mutant("system-prompt-unseeded", "the system-prompt draw is a pure function of (seed, index) (I6)",
           "data/chat.py", "rnd = random.Random(derive_seed(opts.seed, SYSTEM_STREAM, index))", "rnd = random.Random()",
           ("tests/test_chat.py::test_a_system_prompt_is_added_to_the_given_ratio_as_a_pure_function_of_seed_and_index",)),
    Mutant("fsdp-sum-out-of-order", "under fsdp + canonical, micro-batch gradients are summed in micro-batch order (I19)",
           "runtime/sharding.py", "        for s in range(first, w):  # micro-batch i", "        for s in reversed(range(first, w)):  # micro-batch i",
           ("tests/test_sharding.py::test_a_run_that_moves_from_ddp_to_fsdp_and_back_on_other_world_sizes_is_the_uninterrupted_run_bit_for_bit",)),
    Mutant("fsdp-clip-by-shard-norms", "under fsdp + canonical, the clipping norm does not depend on the sharding (I19)",
           "runtime/sharding.py", "        torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), max_norm, total)",
           "        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)",
           ("tests/test_sharding.py::test_a_run_that_moves_from_ddp_to_fsdp_and_back_on_other_world_sizes_is_the_uninterrupted_run_bit_for_bit",)),
    Mutant("shard-not-listed", "every rank's state file is in the one manifest (I19, I23)",
           "checkpoint/format.py", "            for part in results:\n                entries.update", "            for part in results[:1]:\n                entries.update",
           ("tests/test_sharding.py::test_a_run_that_moves_from_ddp_to_fsdp_and_back_on_other_world_sizes_is_the_uninterrupted_run_bit_for_bit",)),
    Mutant("unlisted-files-accepted", "a file the manifest does not list makes its checkpoint not verify (I13, I19)",
           "checkpoint/storage.py", "    if not foreign_ok:\n        check_foreign(folder, body)", "    pass",
           ("tests/test_checkpoint_io.py::test_verify_names_the_file_and_what_failed",)),
    Mutant("dcp-metadata-pickle", "DCP's metadata is unpickled by an allow-list: loading never runs code (I10)",
           "checkpoint/format.py", "        metadata = _MetadataUnpickler(io.BytesIO(data)).load()", "        metadata = pickle.loads(data)",
           ("tests/test_sharding.py::test_the_states_metadata_is_unpickled_by_an_explicit_allow_list_and_nothing_else_is_built",)),
    Mutant("metadata-by-module-prefix", "the allow-list names each class where it is defined, not a module prefix (I10)",
           "checkpoint/format.py",
           "        if name in _METADATA_CLASSES.get(module, ()):\n            obj = getattr(importlib.import_module(module), name, None)\n"
           "            # Defined where it is looked up: a name another module re-exports is not the class we mean.\n"
           "            if obj is not None and getattr(obj, \"__module__\", None) == module:\n",
           "        if module.startswith(\"torch.distributed.checkpoint\") or name in _METADATA_CLASSES.get(module, ()):\n"
           "            obj = getattr(importlib.import_module(module), name, None)\n            if obj is not None:\n",
           ("tests/test_sharding.py::test_the_states_metadata_is_unpickled_by_an_explicit_allow_list_and_nothing_else_is_built",)),
    Mutant("manifest-before-fsync", "every file is on disk before the manifest vouches for it (I8)",
           "checkpoint/storage.py",
           "        finally:\n            for done in fsyncs:\n                done.result()  # every file is on disk before the manifest vouches for it\n"
           "        manifest = {k: v.result() if isinstance(v, Future) else v for k, v in manifest.items()}\n"
           "        body = sign({\"format\": FORMAT, **manifest, \"step\": step, \"files\": entries})\n"
           "        write_file(tmp / MANIFEST, (json.dumps(body, indent=1, sort_keys=True) + \"\\n\").encode())\n",
           "        finally:\n            pass\n"
           "        manifest = {k: v.result() if isinstance(v, Future) else v for k, v in manifest.items()}\n"
           "        body = sign({\"format\": FORMAT, **manifest, \"step\": step, \"files\": entries})\n"
           "        write_file(tmp / MANIFEST, (json.dumps(body, indent=1, sort_keys=True) + \"\\n\").encode())\n"
           "        for done in fsyncs:\n            done.result()\n",
           ("tests/test_checkpoint_io.py::test_every_file_is_fsynced_before_the_manifest_that_vouches_for_it_is_written",)),
    Mutant("evaluation-in-training-mode", "evaluation reads the model in eval mode: no dropout drawn, nothing changed (I15)",
           "objectives/next_token.py",
           "    model.eval()\n", "",
           ("tests/test_watching.py::test_evaluating_changes_no_training_bit_and_logs_val_loss_at_its_steps",)),
    Mutant("moe-aux-loss-dropped", "an MoE micro-batch's loss holds MiniMind's load-balancing loss (docs/models.md) (I25)",
           "objectives/next_token.py", "            loss = loss + aux\n", "            loss = loss\n",
           ("tests/test_models.py::test_the_objectives_loss_holds_the_load_balancing_loss_of_each_micro_batch",)),
    Mutant("moe-top-k-not-renormalized", "the chosen experts' probabilities are renormalized (norm_topk_prob)",
           "model/model.py", "            weights = weights / weights.sum(dim=-1, keepdim=True)\n", "            pass\n",
           ("tests/test_models.py::test_a_minimind_3_pth_loads_through_init_from_and_gives_minimind_s_own_logits",)),
    Mutant("qk-norm-after-rope", "q/k norms apply before the rotary embedding (MiniMind-3, Qwen3)",
           "model/model.py", "        if self.qk_norm:\n            q, k = self.q_norm(q), self.k_norm(k)\n        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)\n",
           "        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)\n        if self.qk_norm:\n            q, k = self.q_norm(q), self.k_norm(k)\n",
           ("tests/test_models.py::test_a_minimind_3_pth_loads_through_init_from_and_gives_minimind_s_own_logits",)),
    Mutant("compile-deterministic-dropped", "compiled kernels are Inductor's deterministic ones, after every frame (performance.md) (I26)",
           "runtime/speed.py", "    torch.use_deterministic_algorithms(True, warn_only=not deterministic)\n", "",
           ("tests/test_compile.py::test_compiled_runs_on_1_process_and_on_2_halted_then_3_resumed_under_fsdp_are_bit_identical",)),
    Mutant("compile-shape-not-in-key", "a compiled graph is one shape's: another shape compiles anew, and is warned (I26)",
           "runtime/speed.py", "torch.compile(block.forward, backend=BACKEND, dynamic=False)",
           "torch.compile(block.forward, backend=BACKEND, dynamic=True)",
           ("tests/test_compile.py::test_a_graph_break_and_a_recompile_after_the_first_step_are_warned",)),
    Mutant("checkpointing-rng-not-preserved", "a recomputed block draws the dropout masks of its forward again (bit-identical) (I6)",
           "model/model.py", "checkpoint(self._forward, x, cos, sin, cache, mask, use_reentrant=False)",
           "checkpoint(self._forward, x, cos, sin, cache, mask, use_reentrant=False, preserve_rng_state=False)",
           ("tests/test_compile.py::test_activation_checkpointing_full_and_every_2_are_bit_identical_to_none_with_dropout",)),
    Mutant("lora-b-not-zero", "fresh adapters leave the base model as it was: B = 0 (docs/lora.md)",
           "model/lora.py", "                adapted.lora_B.weight.zero_()\n", "                nn.init.normal_(adapted.lora_B.weight, std=0.02)\n",
           ("tests/test_lora.py::test_fresh_adapters_leave_the_base_model_as_it_was_and_train_alone",)),
    Mutant("lora-scale-dropped", "the update is scaled by alpha / rank, as PEFT scales it",
           "model/lora.py", "self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scale", "self.lora_B(self.lora_A(self.lora_dropout(x)))",
           ("tests/test_lora.py::test_peft_reads_our_adapter_over_our_hf_export_of_the_base_and_gives_our_logits",)),
    Mutant("lora-base-trainable", "the base is frozen: no gradient, no optimizer state, not in the checkpoint (I27)",
           "model/lora.py", "        p.requires_grad_(False)\n", "        pass\n",
           ("tests/test_lora.py::test_fresh_adapters_leave_the_base_model_as_it_was_and_train_alone",)),
    Mutant("dpo-mean-not-sum", "a side's log-probability is the sum over its taught tokens (TRL's, MiniMind's), not their mean (I28)",
           "objectives/dpo.py", "    return (lp.unsqueeze(-1) * onehot).sum(1)\n",
           "    return (lp.unsqueeze(-1) * onehot).sum(1) / onehot.sum(1).clamp(min=1)\n",
           ("tests/test_dpo.py::test_our_loss_and_rewards_on_packed_pairs_equal_trls_dpo_trainer_on_the_same_pairs",)),
    Mutant("dpo-beta-dropped", "the loss is -log sigmoid(beta * delta)",
           "objectives/dpo.py", "losses = -F.logsigmoid(self.cfg.beta * delta)", "losses = -F.logsigmoid(delta)",
           ("tests/test_dpo.py::test_our_loss_and_rewards_on_packed_pairs_equal_trls_dpo_trainer_on_the_same_pairs",)),
    Mutant("dpo-reference-follows-policy", "the reference is a frozen copy: it never trains (I27)",
           "objectives/dpo.py", "            self.reference = reference\n", "            self.reference = self.policy\n",
           ("tests/test_dpo.py::test_a_live_reference_gives_the_precomputed_references_bits",)),
    Mutant("dpo-chosen-rejected-swapped", "the chosen side is preferred over the rejected one",
           "objectives/dpo.py", "chosen, rejected = policy[:, 0::2] - ref[:, 0::2], policy[:, 1::2] - ref[:, 1::2]",
           "rejected, chosen = policy[:, 0::2] - ref[:, 0::2], policy[:, 1::2] - ref[:, 1::2]",
           ("tests/test_dpo.py::test_our_loss_and_rewards_on_packed_pairs_equal_trls_dpo_trainer_on_the_same_pairs",)),
    Mutant("grpo-sampling-seeded-by-rank", "a completion's draws are (seed, step, prompt, r)'s, whichever rank makes them (docs/rl.md) (I29)",
           "objectives/grpo.py", "derive_seed(self.seed, STREAM, self.step, index, r)", "derive_seed(self.seed, STREAM, self.step, index, r, self.rt.rank)",
           (GRPO_CHAIN,)),
    Mutant("grpo-group-std-left-out", "advantages are the group's rewards normalized by its std",
           "objectives/grpo.py", "return ((grouped - mean) / (std + 1e-4)).view(-1)", "return (grouped - mean).view(-1)",
           ("tests/test_grpo.py::test_advantages_are_the_group_normalized_rewards_and_zero_for_a_group_of_equal_rewards",)),
    Mutant("grpo-ratio-clamp-removed", "GRPO clips the ratio to [1 - eps, 1 + eps]",
           "objectives/grpo.py", "torch.min(ratio * a, torch.clamp(ratio, 1 - cfg.eps, 1 + cfg.eps) * a)", "torch.min(ratio * a, ratio * a)",
           ("tests/test_grpo.py::test_the_cispo_and_grpo_losses_are_the_formulas_on_a_fixed_batch",)),
    Mutant("grpo-rollout-buffer-not-saved", "a rollout under update is in the resume state (I29)",
           "objectives/grpo.py", 'return {"rollout": RolloutState(self, self.rt)} if self.cfg.updates_per_rollout > 1 else {}', "return {}",
           (GRPO_CHAIN,)),
    Mutant("convert-journal-ignored", "a conversion killed at any step of its sequence is finished by the rerun (I13)",
           "cli/convert.py", "    done = finish(root)\n", "    done = None\n",
           ("tests/test_convert.py::test_a_conversion_killed_at_any_step_is_finished_by_the_rerun_and_no_resume_meanwhile_loads_an_older_step",)),
    Mutant("resume-ignores-convert-journal", "no resume loads anything while a conversion is under way (I13)",
           "checkpoint/manager.py", "        if isinstance(self.root, Path) and (self.root / CONVERT_JOURNAL).exists():\n", "        if False:\n",
           ("tests/test_convert.py::test_a_resume_is_refused_while_a_conversion_journal_is_there_even_with_no_other_checkpoint",)),
    Mutant("convert-keys-not-filled", "a converted record has every key added since, at the old release's behaviour",
           "cli/convert.py", "    return fill(config, to_dict(Config()), \"\"), filled\n", "    return dict(config), filled\n",
           ("tests/test_convert.py::test_a_run_the_previous_release_wrote_converts_and_resumes_to_the_uninterrupted_runs_bits",)),
    Mutant("peft-base-absolute", "a PEFT adapter names its base relative to its folder or as the user gives it, never by an absolute path (docs/lora.md)",
           "weights/exports.py", "    return os.path.relpath(source, os.path.abspath(out)) if source else None\n", "    return source\n",
           ("tests/test_exports.py::test_export_peft_names_its_base_relative_to_the_adapter_folder_or_as_given_never_as_an_absolute_path",)),
    Mutant("peft-with-base-absolute", "an adapter exported with its base loads after the folder moves, from any working directory (docs/lora.md)",
           "weights/exports.py", "    if with_base:\n        return BASE_FOLDER\n",
           "    if with_base:\n        return os.path.join(os.path.abspath(out), BASE_FOLDER)\n",
           ("tests/test_exports.py::test_a_peft_adapter_exported_with_its_base_loads_after_the_folder_moves_from_any_working_directory_as_the_docs_say",)),
    Mutant("export-without-tokenizer", "the Hugging Face export carries a tokenizer AutoTokenizer loads, the byte tokenizer's included (docs/weights.md)",
           "weights/exports.py", "    return dict(files) if tokenizers.TOKENIZER_FILE in files else tokenizers.byte_tokenizer_files(seq_len)\n",
           "    return dict(files)\n",
           ("tests/test_exports.py::test_the_hf_export_of_a_byte_tokenizer_run_carries_a_tokenizer_autotokenizer_loads_with_our_ids_and_chat_template",)),
    Mutant("chat-sampling-defaults-split", "chat and generate share one set of sampling defaults (docs/sft.md)",
           "cli/chat.py", "    sampling_arguments(p)\n", "    sampling_arguments(p)\n    p.set_defaults(temperature=0.0)\n",
           ("tests/test_exports.py::test_chat_and_generate_have_one_set_of_sampling_defaults_a_sampling_one_with_a_repetition_penalty",)),
    Mutant("reward-timeout-ignored", "a reward call is bounded by train.grpo.reward_timeout_s: a hanging one fails every rank, named (I24)",
           "objectives/rewards.py", "value = fn.call((prompt, completion), kwargs, timeout_s)", "value = fn.call((prompt, completion), kwargs, None)",
           ("tests/test_grpo.py::test_a_reward_call_is_killed_at_its_timeout_even_inside_c_or_catching_every_exception_and_the_next_call_answers",)),
    Mutant("user-code-in-process", "a user's tools run in the worker process, not in the trainer's where a hang inside C cannot be bounded",
           "objectives/rewards.py", "    return WORKER.load(spec, key)  # the user's code runs in this rank's worker process, every call bounded\n",
           "    import importlib.util as u\n    s = u.spec_from_file_location('m', spec.rpartition(':')[0])\n    m = u.module_from_spec(s)\n"
           "    s.loader.exec_module(m)\n    return getattr(m, spec.rpartition(':')[2]), {'spec': spec}\n",
           ("tests/test_agent.py::test_a_tool_that_hangs_inside_c_is_killed_at_its_timeout_and_the_run_exits_1_naming_it",)),
    Mutant("store-source-recorded-as-its-copy", "a first-weights source in the store is recorded by its URL, not by the staging copy a fresh node lacks",
           "weights/sources.py", 'record = {"path": url or str(folder.resolve()),', 'record = {"path": str(folder.resolve()),',
           ("tests/test_object_storage.py::test_a_run_in_the_store_is_a_model_init_from_source_for_a_fresh_node_and_has_nothing_to_convert",)),
    Mutant("staging-chunk-written-by-path", "a staging copy's chunks are checked and filled in the file the reader maps, not whatever the path names later",
           "data/chunked.py", "            os.pwrite(self.fd, data, start)", "            os.pwrite(os.open(self.path, os.O_RDWR), data, start)",
           ("tests/test_object_storage_data.py::test_a_staging_copy_packed_over_by_another_run_of_the_node_leaves_this_readers_rows_the_stores_bytes",)),
    Mutant("parser-calls-unchecked", "a call the run's parser returns that a reply cannot carry is a 500 naming the parser, not a broken reply",
           "cli/serve.py", '                json.dumps(call.get("arguments", {}), ensure_ascii=False, allow_nan=False)\n', "                pass\n",
           ("tests/test_serve.py::test_a_parser_returning_a_call_no_reply_can_carry_gets_that_request_a_500_naming_it_streamed_or_not",)),
    Mutant("worker-pins-outlive-the-run", "the user code a run pinned ends with the run: a later run in the same interpreter pins its own",
           "train.py", "            WORKER.close()  # the user code this run pinned ends with it (objectives/worker.py)\n", "",
           ("tests/test_grpo.py::test_a_run_in_the_same_interpreter_pins_only_its_own_code_not_an_ended_runs",)),
    Mutant("user-code-not-killed-at-timeout", "user code past its timeout is killed in its worker process, a hang inside C too",
           "objectives/worker.py", "        except TimeoutError:\n            self.kill()\n", "        except TimeoutError:\n",
           ("tests/test_grpo.py::test_a_reward_call_is_killed_at_its_timeout_even_inside_c_or_catching_every_exception_and_the_next_call_answers",)),
    Mutant("worker-reply-read-unbounded", "a reply from the worker is read against the call's deadline: bytes user code wrote to the socket cannot hang the trainer",
           "objectives/worker.py", "conn.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-6))", "conn.settimeout(None)",
           ("tests/test_agent.py::test_a_tool_that_writes_to_the_workers_socket_forks_or_starts_a_child_is_bounded_answers_its_own_call_and_leaves_nothing",)),
    Mutant("worker-reply-number-unchecked", "a reply is the call's own (its number): one user code wrote, or a stale one, kills the worker",
           "objectives/worker.py", "reply[0] == self.number)", "True)",
           ("tests/test_agent.py::test_a_tool_that_writes_to_the_workers_socket_forks_or_starts_a_child_is_bounded_answers_its_own_call_and_leaves_nothing",)),
    Mutant("worker-fork-replies", "a child user code forked that returns into the worker's loop exits without replying",
           "objectives/worker.py", "        if os.getpid() != me:", "        if False:",
           ("tests/test_agent.py::test_a_tool_that_writes_to_the_workers_socket_forks_or_starts_a_child_is_bounded_answers_its_own_call_and_leaves_nothing",)),
    Mutant("worker-kill-spares-the-group", "a kill at the timeout ends the worker's process group: what the user's code started goes too",
           "objectives/worker.py", "                os.killpg(self.proc.pid, signal.SIGKILL)", "                self.proc.kill()",
           ("tests/test_agent.py::test_a_tool_that_writes_to_the_workers_socket_forks_or_starts_a_child_is_bounded_answers_its_own_call_and_leaves_nothing",)),
    Mutant("worker-closed-socket-traceback", "a tool that closes the worker's socket prints no traceback (the worker ends quietly)",
           "objectives/worker.py", "        except OSError:  # the user's code closed the socket", "        except KeyError:  # the user's code closed the socket",
           ("tests/test_agent.py::test_a_tool_that_writes_to_the_workers_socket_forks_or_starts_a_child_is_bounded_answers_its_own_call_and_leaves_nothing",)),
    Mutant("worker-restart-unpinned", "a worker started again after a kill runs only the code the run pinned: a changed tool file fails the run, named",
           "objectives/worker.py", 'if reply[0] != "ok" or reply[2] != sha:', "if False:",
           ("tests/test_agent.py::test_a_tool_file_changed_under_the_run_fails_it_at_the_workers_restart_naming_it_instead_of_running_other_code",)),
    Mutant("worker-reply-unpickled-freely", "a worker's reply crosses as plain values only: bytes a tool writes to the socket run no code in the trainer",
           "objectives/worker.py", "    return _PlainUnpickler(io.BytesIO(data)).load()\n", "    return pickle.loads(data)\n",
           ("tests/test_agent.py::test_a_reply_that_would_run_code_in_the_trainer_does_not_and_the_worker_never_sees_the_keys",)),
    Mutant("worker-sees-the-keys", "the worker (user code) starts without the checkpoint and server keys",
           "objectives/worker.py", "process_group=0, env=_worker_environment())", "process_group=0, env=None)",
           ("tests/test_agent.py::test_a_reply_that_would_run_code_in_the_trainer_does_not_and_the_worker_never_sees_the_keys",)),
    Mutant("math-lcm-unbounded", "calculate_math bounds math.lcm at each argument, not only its result (a built-in has no timeout)",
           "objectives/tools.py", 'if node.func.attr == "lcm" and len(args) > 2:', "if False:",
           ("tests/test_agent.py::test_calculate_math_bounds_math_lcm_at_each_argument_and_a_call_nested_past_the_recursion_limit_is_not_a_call",)),
    Mutant("tool-call-recursion-crashes", "a tool call nested past the recursion limit is skipped, as MiniMind's bare except skips it",
           "objectives/tools.py", "        except (ValueError, RecursionError):  # MiniMind's bare except", "        except ValueError:  # MiniMind's bare except",
           ("tests/test_agent.py::test_calculate_math_bounds_math_lcm_at_each_argument_and_a_call_nested_past_the_recursion_limit_is_not_a_call",)),
    Mutant("reward-purity-unchecked", "a reward that scores the same completion otherwise is refused, named (docs/rl.md)",
           "objectives/grpo.py", "if check and len(scores) == 1:", "if False:",
           ("tests/test_grpo.py::test_a_reward_that_draws_from_random_is_refused_naming_it",)),
    Mutant("rollout-waits-in-a-collective", "ranks wait for a rollout on its heartbeat, never in a collective that times out (I24)",
           "objectives/grpo.py", 'outcomes = hand_off(rt, key, rt.rank, work, self.stall_s, f"the rollout of step {self.step + 1}")',
           "outcomes = {rt.rank: work(None)}",
           ("tests/test_grpo.py::test_a_rollout_on_one_rank_longer_than_dist_timeout_s_is_waited_for_and_gives_the_uninterrupted_figures",)),
    Mutant("rollout-not-interruptible", "a stop signal inside a rollout stops every rank with 75, the step before it saved (I16)",
           "objectives/grpo.py", "stop.interruptible() if stop else contextlib.nullcontext()", "contextlib.nullcontext()",
           ("tests/test_grpo.py::test_sigterm_while_a_reward_waits_stops_both_ranks_with_75_and_the_resume_equals_the_uninterrupted_run",)),
    Mutant("grpo-rollout-compiled", "under train.compile the rollout runs eagerly: the compiled training graphs do not depend on it (I26)",
           "objectives/grpo.py", 'torch.compiler.set_stance("force_eager")', "contextlib.nullcontext()",
           ("tests/test_compile.py::test_a_compiled_grpo_run_halted_on_2_and_resumed_on_1_equals_the_uninterrupted_one_its_rollouts_eager",)),
    Mutant("top-p-unstable-ties", "top_p breaks ties by token id, the same on any device (I29)",
           "model/generate.py", "order = torch.sort(some, dim=-1, descending=True, stable=True).indices",
           "order = torch.argsort(some, dim=-1, descending=True)",
           ("tests/test_grpo.py::test_top_p_keeps_tied_ids_in_id_order_whatever_the_vocabulary_size",)),
    Mutant("moe-keys-without-experts", "a model.moe key set without experts is refused naming it",
           "model/config.py", 'self.experts or f.name == "experts"', 'True or f.name == "experts"',
           ("tests/test_models.py::test_a_model_config_that_cannot_be_built_names_the_key_and_both_values",)),
    Mutant("identity-in-dict-order", "a model's identity is the same however its source was read (I30)",
           "checkpoint/storage.py", "    for name in sorted(state_dict):\n", "    for name in state_dict:\n",
           ("tests/test_identity.py::test_the_identity_is_one_in_any_dict_order_and_another_for_a_name_a_shape_or_a_byte",
            "tests/test_identity.py::test_the_same_weights_from_a_run_folder_an_hf_folder_a_minimind_pth_and_safetensors_have_one_identity_in_every_process")),
    Mutant("identity-without-names-or-shapes", "a model's identity covers its parameters' names and shapes and its architecture (I30)",
           "checkpoint/storage.py", '        h.update(f"{name}\\0float32\\0{list(t.shape)}\\n".encode())\n', "",
           ("tests/test_identity.py::test_the_identity_is_one_in_any_dict_order_and_another_for_a_name_a_shape_or_a_byte",)),
    Mutant("identity-without-architecture", "two head layouts over the same bytes are two identities (I30)",
           "checkpoint/storage.py", 'json.dumps({"identity": IDENTITY, "architecture": architecture}', 'json.dumps({"identity": IDENTITY}',
           ("tests/test_identity.py::test_two_seeded_inits_with_4_and_8_heads_share_their_bytes_but_not_their_identity",)),
    Mutant("loaded-identity-unchecked", "what a resume loaded is what was saved: its identity is the manifest's (I30)",
           "checkpoint/manager.py", '                self._check_identity(path, manifest, target.get("model"))\n', "",
           ("tests/test_identity.py::test_a_step_folder_whose_metadata_swaps_two_tensors_and_whose_manifest_was_updated_falls_back_to_the_previous_one",)),
    Mutant("fallback-keeps-the-scaler", "a fallback restores everything its checkpoint holds; an optional state it lacks (the GradScaler) starts fresh (I30)",
           "checkpoint/manager.py", "                elif name in self._fresh:", "                elif False:",
           ("tests/test_checkpoint_manager.py::test_a_fallback_restores_everything_the_previous_checkpoint_holds_and_an_optional_state_it_lacks_starts_fresh",)),
    Mutant("load-applied-before-verified", "a checkpoint that fails a check applies nothing to the model, optimizer, scaler or generators (I30)",
           "checkpoint/manager.py", "                if not getattr(obj, \"target_is_new\", False):\n                    target[name] = _apart(target[name])\n", "",
           ("tests/test_checkpoint_manager.py::test_a_checkpoint_that_fails_its_checks_applies_nothing_to_the_model_optimizer_scaler_or_generators",)),
    Mutant("identity-optional-in-format-3", "a format-3 manifest without the model's identity is a damaged checkpoint (I30)",
           "checkpoint/manager.py", "            if manifest.get(\"format\", 0) >= 3:", "            if False:",
           ("tests/test_checkpoint_manager.py::test_a_format_3_manifest_without_its_identity_is_a_damaged_checkpoint_and_falls_back_naming_it",)),
    Mutant("optimizer-identity-unchecked", "what a resume loaded into the optimizer is what was saved: its identity is the manifest's (I30)",
           "checkpoint/manager.py", "                self._check_optimizer(path, manifest, target.get(\"optimizer\"), ahead)\n", "",
           ("tests/test_checkpoint_manager.py::test_an_optimizer_state_whose_moments_were_swapped_with_the_files_hash_rewritten_is_refused_and_falls_back",)),
    Mutant("manifest-mac-unchecked", "with MINIMIND_CHECKPOINT_KEY set, a manifest without a valid MAC is not loaded (I35)",
           "checkpoint/storage.py", "    if key is None:\n        return\n    got = body.get(MAC)\n", "    return\n    got = body.get(MAC)\n",
           ("tests/test_signed_checkpoints.py::test_with_the_key_set_a_manifest_without_its_valid_mac_is_named_and_the_run_falls_back",
            "tests/test_object_storage.py::test_with_a_checkpoint_key_a_manifest_in_the_store_edited_without_it_is_refused_naming_it_and_the_previous_step_loads")),
    Mutant("seeded-base-reseeds-the-run", "reading a pinned model leaves the run's global generators alone (I6)",
           "weights/sources.py", "        with generators_apart():", "        with torch.random.fork_rng(devices=[]):",
           ("tests/test_identity.py::test_reading_a_seeded_init_as_a_base_or_reference_leaves_pythons_numpys_and_torchs_generators_alone",)),
    Mutant("dpo-table-keyed-by-path", "DPO's precomputed table is named by the rows' content, not their path (I31)",
           "objectives/dpo.py", 'tables.table_files(self.dataset, meta.data_fingerprint, sha, f"S{self.segments}"',
           'tables.table_files(self.dataset, {"path": str(self.dataset.bin_path)}, sha, f"S{self.segments}"',
           ("tests/test_dpo.py::test_an_edited_preference_file_of_the_same_size_gets_a_new_table_and_the_stale_one_is_removed",)),
    Mutant("dpo-precompute-without-autocast", "the precomputed reference runs under the live one's autocast (I31)",
           "objectives/dpo.py", 'autocast = nullcontext() if strategy == "fsdp" else runtime_autocast(rt.device, dtype)', "autocast = nullcontext()",
           ("tests/test_dpo.py::test_live_and_precomputed_references_give_the_same_bits_under_bfloat16_autocast",)),
    Mutant("table-precompute-restarts", "a stop during a table's precompute keeps its published chunks: the next launch continues from them (I31)",
           "objectives/tables.py", "    have, manifest = read_verified(files, empty, what)\n", "    have, manifest = {}, {}\n",
           ("tests/test_tables.py::test_the_helper_keeps_published_chunks_across_a_stop_computes_only_the_rest_and_writes_the_same_bytes",
            "tests/test_tables.py::test_a_precompute_stopped_twice_by_sigterm_continues_from_its_chunks_to_the_uninterrupted_runs_table_and_bits")),
    Mutant("table-read-unverified", "a precomputed table is read only through its manifest's hashes: a damaged chunk is computed again (I31)",
           "objectives/tables.py", 'if data is not None and hashlib.sha256(data).hexdigest() != (entry or {}).get("sha256"):', "if False:",
           ("tests/test_tables.py::test_the_helper_keeps_published_chunks_across_a_stop_computes_only_the_rest_and_writes_the_same_bytes",
            "tests/test_tables.py::test_a_damaged_chunk_or_manifest_of_the_dpo_table_is_named_computed_again_and_the_run_is_the_undamaged_ones",
            "tests/test_distill.py::test_a_damaged_chunk_of_the_teacher_table_is_named_computed_again_and_the_run_is_the_undamaged_ones")),
    Mutant("distill-kl-per-micro-batch-mean", "distillation's step loss is per taught token of the global batch, not MiniMind's batchmean per micro-batch (I17)",
           "objectives/distill.py", "loss = (alpha * ce + (1 - alpha) * kl) * self.micro_batches / self.taught",
           "loss = alpha * ce * self.micro_batches / self.taught + (1 - alpha) * kl / len(student)",
           ("tests/test_distill.py::test_the_steps_loss_is_per_taught_token_of_the_global_batch_whatever_the_split",)),
    Mutant("distill-temperature-squared-dropped", "the KL is scaled by T^2, as MiniMind's distillation_loss (docs/distill.md)",
           "objectives/distill.py", 'return temperature ** 2 * F.kl_div(log_q, p, reduction="sum")', 'return F.kl_div(log_q, p, reduction="sum")',
           ("tests/test_distill.py::test_our_loss_on_one_row_is_minimind_s_distillation_loss_and_ce_kl_combination",)),
    Mutant("distill-teacher-without-mask", "the teacher reads packed rows with their positions and block-diagonal mask (I18)",
           "objectives/distill.py", "pos = positions[b:b + 1] if positions is not None else None", "pos = None",
           ("tests/test_distill.py::test_the_teacher_sees_the_packed_rows_positions_and_block_diagonal_mask",)),
    Mutant("distill-teacher-not-pinned", "a resume with another teacher is refused naming both identities (I27)",
           "objectives/distill.py", "teacher, sha, path = pinned_reference(cfg, rt, meta, resumed, agree,",
           "teacher, sha, path = pinned_reference(cfg, rt, meta, None, agree,",
           ("tests/test_distill.py::test_a_resume_against_another_teacher_is_refused_naming_both_identities_and_its_export_resumes",)),
    Mutant("distill-table-keyed-by-path", "the teacher's top-k table is named by the rows' content, not their path (I31)",
           "objectives/distill.py", "table = tables.table_files(self.dataset, meta.data_fingerprint, sha,",
           'table = tables.table_files(self.dataset, {"path": str(self.dataset.bin_path)}, sha,',
           ("tests/test_distill.py::test_an_edited_text_corpus_of_the_same_size_gets_a_new_teacher_table_and_the_stale_one_is_removed",)),
    Mutant("chunk-coverage-unchecked", "every tensor's chunks in DCP's metadata cover it exactly once: nothing is left as memory held it (I10, I13)",
           "checkpoint/format.py", "        if sum(math.prod(b[1]) for b in boxes) != math.prod(size):\n", "        if False:\n",
           ("tests/test_checkpoint_hardening.py::test_a_tensor_whose_chunks_leave_a_gap_is_refused_not_loaded_with_what_memory_held",)),
    Mutant("symlink-followed", "nothing in a step folder is followed through a symbolic link: nothing outside the run is deleted (I13)",
           "checkpoint/files.py", "            if stat.S_ISLNK(os.lstat(path).st_mode):\n", "            if False:\n",
           ("tests/test_checkpoint_hardening.py::test_republishing_a_step_whose_state_folder_is_a_link_deletes_nothing_at_the_links_target",)),
    Mutant("full-disk-unnamed", "a full disk while the states are written is named with the file, not torch's \"unexpected pos\" (I16)",
           "checkpoint/files.py", "                    continue\n                raise OSError(e.errno, e.strerror or str(e), str(self.path)) from None\n",
           "                    continue\n                raise\n",
           ("tests/test_checkpoint_hardening.py::test_a_full_disk_while_dcp_writes_the_states_names_the_file_and_no_space_left_on_device",)),
    Mutant("publish-listed-files-unchecked", "the coordinator publishes only files every rank listed that it can verify (I8)",
           "checkpoint/format.py", '            check_written(self.folder, entries, own=self.own)\n', "            pass\n",
           ("tests/test_checkpoint_hardening.py::test_the_coordinator_publishes_only_when_every_file_another_rank_listed_is_here_and_verifies",)),
    Mutant("state-hash-over-another-buffer", "a state file's sha256 is over the very bytes written, in the write's pass (issue 48)",
           "checkpoint/files.py", "        self.sha.update(data)\n", "        self.sha.update(bytes(data.nbytes))\n",
           ("tests/test_checkpoint_format.py::test_every_tensor_is_written_raw_at_the_offset_its_metadata_records_and_reads_back_bit_for_bit",)),
    Mutant("resume-other-files-unverified", "a resumed checkpoint is whole: the files DCP does not read (fp16 weights, tokenizer) verified too (I13)",
           "checkpoint/manager.py",
           '        others = _hasher.submit(store.verify, path, manifest, lambda name: not name.startswith(f"{format.STATE}/")) \\\n'
           "            if self.comm.is_main else None\n",
           "        others = None\n",
           ("tests/test_checkpoint_manager.py::test_a_resume_verifies_every_file_the_manifest_lists_not_only_the_states_it_reads",)),
    Mutant("direct-io-never-set", "a checkpoint's whole blocks are written with O_DIRECT where the filesystem takes it (issue 48)",
           "checkpoint/files.py", "            self.direct = self.tried_direct = n == STAGE_BLOCK and self._set_direct(True)\n",
           "            self.direct = self.tried_direct = False\n",
           ("tests/test_checkpoint_io.py::test_a_stream_writer_hashes_every_byte_in_file_order_and_writes_whole_blocks_with_o_direct_where_the_filesystem_takes_it",)),
    Mutant("config-non-finite-accepted", "a config value of nan or inf is refused naming the key, exit 2, before anything runs (I16)",
           "configs/__init__.py", "            if not math.isfinite(number):", "            if False:",
           ("tests/test_config.py::test_a_bad_override_is_an_error_naming_the_key_and_what_was_expected",)),
    Mutant("config-duplicate-key-kept", "a key given twice in a config file is refused naming both lines, not the last one kept (I16)",
           "configs/__init__.py", "            if isinstance(key, typing.Hashable) and key in seen:", "            if False:",
           ("tests/test_config.py::test_a_bad_file_is_an_error_naming_the_file",)),
    Mutant("config-float32-range-unchecked", "a float key beyond float32's range is refused naming the key, exit 2, not a crash in the optimizer (I16)",
           "configs/__init__.py", "            if abs(number) > FLOAT32_MAX:", "            if False:",
           ("tests/test_config.py::test_a_bad_override_is_an_error_naming_the_key_and_what_was_expected",)),
    Mutant("config-override-duplicate-key-kept", "a key given twice in a command-line mapping is refused naming it, as in a file (I16)",
           "configs/__init__.py", "            value = yaml.load(raw, Loader=_UniqueKeys) if raw.strip() else \"\"",
           "            value = yaml.safe_load(raw) if raw.strip() else \"\"",
           ("tests/test_config.py::test_a_bad_override_is_an_error_naming_the_key_and_what_was_expected",)),
    Mutant("runtime-limits-unchecked", "runtime.threads and dist.timeout_s beyond what torch takes are refused naming the key, exit 2 (I16)",
           "runtime/setup.py", "        if not 0 <= self.threads <= MAX_THREADS:", "        if self.threads < 0:",
           ("tests/test_config.py::test_a_bad_override_is_an_error_naming_the_key_and_what_was_expected",)),
    Mutant("mkl-default-branch", "the same command gives the same bits: the trainer and the tools run MKL in its reproducible mode unless the user chose one (I26)",
           "common/kernels.py", '    if "MKL_CBWR" not in os.environ and _has_avx2():', "    if False:",
           ("tests/test_model.py::test_the_trainer_and_the_tools_put_mkl_in_its_reproducible_mode_unless_the_user_chose_one",)),
    Mutant("log-line-split-write", "a rank's line and its newline go to the shared stderr in one write, so two ranks' lines never join (I16)",
           "runtime/logs.py", '            tqdm.write(self.format(record) + "\\n", file=self.stream, end="")\n',
           "            tqdm.write(self.format(record), file=self.stream)\n",
           ("tests/test_protocol.py::test_a_rank_s_line_and_its_newline_go_out_in_one_write_so_two_ranks_lines_never_join",)),
    Mutant("raw-bounds-unchecked", "every item's bytes lie inside its file, checked before anything is allocated (issue 48)",
           "checkpoint/format.py", "        if not _count(offset) or not _count(length) or offset + length > sizes[rel]:\n",
           "        if not _count(offset) or not _count(length):\n",
           ("tests/test_checkpoint_format.py::test_a_damaged_or_forged_layout_is_refused_before_anything_is_allocated",)),
    Mutant("raw-item-read-at-wrong-offset", "a tensor's raw bytes are read from the offset its metadata records (issue 48)",
           "checkpoint/format.py", "                    r.skip(info.offset - r.size)\n", "                    r.skip(info.offset - r.size + 4)\n",
           ("tests/test_checkpoint_format.py::test_every_tensor_is_written_raw_at_the_offset_its_metadata_records_and_reads_back_bit_for_bit",)),
    Mutant("raw-read-hash-unchecked", "a state file read in place is used only if the sha256 of the bytes read is the manifest's (issue 48)",
           "checkpoint/format.py", "            if r.size != entry[\"bytes\"] or sha != entry[\"sha256\"]:\n", "            if False:\n",
           ("tests/test_checkpoint_manager.py::test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one",)),
    Mutant("raw-length-unchecked", "a raw item is exactly its chunk's elements, of the chunk's dtype and shape (issue 48)",
           "checkpoint/format.py", "                    or info.length != math.prod(lengths) * dtype.itemsize:\n", "                    or False:\n",
           ("tests/test_checkpoint_format.py::test_a_damaged_or_forged_layout_is_refused_before_anything_is_allocated",)),
    Mutant("compressed-record-read", "an item whose zip records are compressed is refused before it inflates (I10)",
           "checkpoint/format.py", "        if r.compress_type != zipfile.ZIP_STORED or r.file_size > size:\n", "        if False:\n",
           ("tests/test_checkpoint_hardening.py::test_an_item_whose_zip_records_are_compressed_is_refused_before_it_inflates",)),
    Mutant("structure-mismatch-unnamed", "a checkpoint of another structure is refused naming the key, not reported as damaged (I16)",
           "checkpoint/manager.py", "        if any(misfits):\n", "        if False:\n",
           ("tests/test_checkpoint_hardening.py::test_a_state_of_another_shape_after_a_may_change_key_is_refused_naming_the_tensor_and_the_key",)),
    Mutant("old-layout-exit-1", "a checkpoint of the earlier layout is bad input (exit 2) with the command that converts it (I16)",
           "checkpoint/storage.py", "class OldLayout(CheckpointError, BadInput):\n", "class OldLayout(CheckpointError):\n",
           ("tests/test_checkpoint_hardening.py::test_a_checkpoint_of_the_earlier_layout_is_bad_input_for_a_run",)),
    Mutant("preempt-exit-trap-fails", "scripts/preempt.sh exits 0 after PASS: its EXIT trap ends in no failed test (I16)",
           "scripts/preempt.sh", 'cleanup() { if [ -n "$PGID" ]; then kill_tree KILL "$PGID"; fi; }', 'cleanup() { [ -n "$PGID" ] && kill_tree KILL "$PGID"; }',
           ("tests/test_first_hour.py::test_preempt_sh_prints_pass_and_exits_0_in_both_documented_modes[default]",)),
    Mutant("refused-folder-left-behind", "a launch refused for bad input before a step takes back the folder it made (I12)",
           "run/folder.py", '    if outcome == "bad_input" and lock.created:\n', "    if False:\n",
           ("tests/test_first_hour.py::test_a_refused_launch_takes_back_only_a_folder_it_made_that_holds_nothing_trained",)),
    Mutant("launch-code-not-the-workers", "runtime.launch exits with the failing worker's code of the table (2: bad input) (I16)",
           "runtime/launch.py", "        code = worker_code(e)\n", "        code = 1\n",
           ("tests/test_first_hour.py::test_a_launch_refused_for_bad_input_before_training_leaves_no_run_folder_and_ends_with_its_line",)),
    Mutant("status-lost-holder-shown-running", "status says a run whose lock nobody holds is stopped, with its last published step (I12)",
           "cli/status.py", 'state = LOST if recorded == "running" and not held else recorded', "state = recorded",
           ("tests/test_first_hour.py::test_status_shows_a_running_runs_step_loss_speed_checkpoint_and_eta_and_a_sigkilled_run_as_stopped",)),
    Mutant("store-manifest-not-create-only", "a step's manifest in the store is created only if none is there: a second writer is refused (I33)",
           "checkpoint/remote.py", "data, create=True, sha256=hashlib.sha256(data).hexdigest())", "data, sha256=hashlib.sha256(data).hexdigest())",
           ("tests/test_object_storage.py::test_two_writers_publishing_one_step_one_wins_and_the_other_is_refused_naming_it_nothing_overwritten",)),
    Mutant("store-pointer-without-cas", "the pointer to the newest step moves only if it is still the one this writer saw (I33)",
           "checkpoint/remote.py", "self.store.put((self.root / POINTER).key, data, if_match=self.pointer_etag)",
           "self.store.put((self.root / POINTER).key, data)",
           ("tests/test_object_storage.py::test_a_writer_whose_pointer_moved_since_it_looked_is_refused_and_prunes_nothing",)),
    Mutant("store-lease-taken-before-expiry", "a live lease is waited for and taken over only once the store's clock says it expired (I33)",
           "common/store.py", 'if head.age_s > max(self.ttl_s, float(info.get("ttl_s") or 0)) + 1:', "if True:",
           ("tests/test_object_storage.py::test_a_live_lease_is_waited_for_then_refused_naming_its_holder_and_taken_over_only_once_expired",)),
    Mutant("store-listed-file-unchecked", "discovery in the store trusts a manifest only when every file it lists is there at its size (I33)",
           "checkpoint/remote.py", "            if size is None:\n                raise", "            if False:\n                raise",
           ("tests/test_object_storage.py::test_a_listed_file_whose_bytes_are_not_the_manifests_is_never_trusted_the_previous_step_is_loaded",)),
    Mutant("store-listed-file-unverified", "a file in the store is used only once its sha256 is the manifest's (I33)",
           "checkpoint/remote.py", "            storage.check_sha(where / name, sha.hexdigest(), entry)\n        return body",
           "            pass\n        return body",
           ("tests/test_object_storage.py::test_a_listed_file_whose_bytes_are_not_the_manifests_is_never_trusted_the_previous_step_is_loaded",)),
    Mutant("store-part-without-its-sha256", "a part uploaded to the store carries its SHA-256: one damaged on its way is refused and sent again (I33)",
           "common/store.py", "Body=bytes(data), ChecksumSHA256=sha)", "Body=bytes(data))",
           ("tests/test_object_storage_faults.py::test_bytes_damaged_on_their_way_are_refused_by_the_store_sent_again_and_the_step_verifies",)),
    Mutant("store-put-without-its-sha256", "an object put in the store carries its SHA-256: one damaged on its way is refused and sent again (I33)",
           "common/store.py", '        kwargs["ChecksumSHA256"] = _b64(sha256 or hashlib.sha256(data).hexdigest())\n', "",
           ("tests/test_object_storage_faults.py::test_bytes_damaged_on_their_way_are_refused_by_the_store_sent_again_and_the_step_verifies",)),
    Mutant("store-complete-unsigned", "a multipart completion's list of parts is bound to its request (its signed payload hash), as every body sent to the store is by a SHA-256 of its bytes (I33)",
           "common/store.py", "self.signed.complete_multipart_upload", "self.client.complete_multipart_upload",
           ("tests/test_object_storage_faults.py::test_every_body_sent_to_the_store_is_bound_to_its_request_by_the_sha256_of_its_bytes",)),
    Mutant("store-upload-unchecked-against-its-record", "a local file uploaded under its recorded sha256 is refused when its bytes no longer hash to it, multipart as one PUT (I33)",
           "common/store.py", "                self._same(path, key, whole, sha256)\n                self.complete(", "                self.complete(",
           ("tests/test_object_storage_faults.py::test_a_file_changed_on_disk_since_it_was_hashed_is_never_uploaded_as_its_record",)),
    Mutant("store-pruned-manifest-remembered", "a step the start finished pruning is found missing when named later: its manifest is not remembered from the prune's read (I33)",
           "checkpoint/remote.py", "        self._manifests.pop(folder.url, None)\n        self._listing = {", "        self._listing = {",
           ("tests/test_object_storage.py::test_a_step_whose_cut_short_prune_the_start_finished_is_not_found_again_by_its_name",)),
    Mutant("store-prune-before-the-pointer", "a step in the store is pruned only once the pointer has moved past it, never the pointer's target (I33)",
           "checkpoint/remote.py", "            if target is None or step >= target:\n", "            if False:\n",
           ("tests/test_object_storage.py::test_pruning_never_takes_the_pointers_target_nor_a_step_the_pointer_has_not_passed",)),
    Mutant("help-launched-per-rank", "scripts/train.sh --help prints the help once and exits 0",
           "scripts/train.sh", 'if [ "$HELP" = 1 ]; then', "if false; then",
           ("tests/test_first_hour.py::test_train_sh_help_prints_the_help_once_and_exits_0",)),
    Mutant("config-error-said-per-rank", "a config error every rank reaches is said once, not once per rank",
           "runtime/logs.py", "    if rank:\n        time.sleep(PEER_GRACE_S)\n", "    pass\n",
           ("tests/test_first_hour.py::test_a_config_error_under_torchrun_is_printed_once_not_once_per_rank",)),
    Mutant("grpo-summary-reports-loss", "GRPO's closing line and the bar report the reward (docs/rl.md)",
           "run/metrics.py", '        return {"reward": record["reward/mean"], "loss": record["loss"]}\n', '        return {"loss": record["loss"]}\n',
           ("tests/test_first_hour.py::test_grpos_closing_line_reports_the_reward",)),
    Mutant("metrics-dropped-silently", "a resume says how many metrics lines it dropped and why (I11)",
           "run/metrics.py", "    if dropped or torn:", "    if False:",
           ("tests/test_first_hour.py::test_a_resume_says_how_many_metrics_lines_it_dropped_and_why",)),
    Mutant("eval-draws-training-randomness", "benchmark tasks scored during training draw nothing from training's generators (I15)",
           "objectives/benchmark.py", "    model.eval()  # no dropout, and the generators forked: nothing of training's is drawn (docs/design.md I15)\n"
                                      "    try:\n        with torch.random.fork_rng(devices=cuda), ", "    try:\n        with ",
           (EVAL_IDENTICAL,)),
    Mutant("eval-leaves-eval-mode", "benchmark tasks scored during training leave the model training (I15)",
           "objectives/benchmark.py", "        model.train(was_training)\n", "        pass\n", (EVAL_IDENTICAL,)),
    Mutant("eval-items-out-of-order", "items scored on several ranks are gathered in item order: one process's figures, item by item",
           "objectives/benchmark.py", "sorted((pair for part in parts for pair in part), key=lambda p: p[0])", "(pair for part in parts for pair in part)",
           ("tests/test_eval.py::test_items_split_across_ranks_and_gathered_give_the_one_process_figures_item_by_item_and_touch_no_generator",)),
    Mutant("acc-norm-by-bytes", "acc_norm divides by the choice's length in characters, as lm-evaluation-harness (not bytes or tokens)",
           "objectives/benchmark.py", '"pred_norm": argmax([ll / len(t) for ll, t in zip(lls, texts)])',
           '"pred_norm": argmax([ll / len(t.encode("utf-8")) for ll, t in zip(lls, texts)])',
           ("tests/test_eval.py::test_acc_norm_divides_by_characters_acc_bytes_by_utf8_bytes_and_ties_go_to_the_first_choice",)),
    Mutant("stream-without-done", "a streamed reply ends with data: [DONE], as OpenAI's",
           "cli/serve.py", '            yield "data: [DONE]\\n\\n"\n', "            pass\n",
           ("tests/test_serve.py::test_a_streamed_reply_is_the_non_streamed_one_in_openai_chunks_ending_with_done_and_greedy_is_chats",)),
    Mutant("half-character-streamed", "no streamed piece ends in half a UTF-8 character",
           "cli/serve.py", '        sure = len(text.rstrip("\\ufffd"))\n', "        sure = len(text)\n",
           ("tests/test_serve.py::test_a_stop_string_ends_the_reply_before_it_and_no_piece_of_it_or_of_a_broken_character_is_sent",)),
    Mutant("left-client-keeps-its-slot", "a client that goes away frees its slot at its next turn",
           "cli/serve.py", "                    if job.cancelled:\n", "                    if False:\n",
           ("tests/test_serve.py::test_past_the_queue_limit_a_request_gets_429_and_a_cancelled_one_frees_its_slot_at_its_next_turn",)),
    Mutant("context-unchecked", "max_tokens past the model's context is a 400 naming max_tokens, and the server goes on",
           "cli/serve.py", "    if max_tokens is not None and len(prompt) + max_tokens > seq_len:\n", "    if False:\n",
           ("tests/test_serve.py::test_bad_input_is_400_with_openais_error_body_naming_the_field_and_the_server_keeps_serving[body10-max_tokens]",)),
    Mutant("request-size-unlimited", "a request body past --max-request-bytes is 413 before the rest of it is read",
           "cli/serve.py", "async def read_body(request, limit: int) -> bytes:\n",
           "async def read_body(request, limit: int) -> bytes:\n    return await request.body()\n",
           ("tests/test_serve.py::test_a_body_past_max_request_bytes_is_413_before_the_rest_is_read_whether_its_length_is_said_or_chunked",)),
    Mutant("echo-drops-prompt-logprobs", "completions with echo give the prompt's own log-probabilities (lm-evaluation-harness's scoring)",
           "cli/serve.py", "            entries = ((job.prompt_entries or []) if req.echo else []) + job.entries\n",
           "            entries = job.entries\n",
           ("tests/test_serve.py::test_completions_echo_gives_each_prompt_ids_log_softmax_and_a_string_prompt_is_generates_continuation",)),
    Mutant("serve-parser-not-trainings", "the server reads tool calls with the run's train.agent.parser, training's code (MiniMind's)",
           "cli/serve.py", '    fn, _ = rewards.load(spec, "train.agent.parser", {"minimind": parse_tool_calls})\n',
           '    fn, _ = rewards.load(spec, "train.agent.parser", {"minimind": lambda text: [json.loads(m) for m in re.findall('
           'r"<tool_call>(.*?)</tool_call>", text) if m.strip().startswith("{")]})\n',
           ("tests/test_serve.py::test_a_reply_is_read_into_content_reasoning_and_tool_calls_as_minimind_s_server_reads_it_with_"
            "trainings_parser",)),
    Mutant("parser-on-the-event-loop", "a slow tool-call parser holds up only the replies it reads (it runs off the server's event loop)",
           "cli/serve.py", "        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)\n",
           "        return fn(*args)\n",
           ("tests/test_serve.py::test_a_parser_sleeping_5_s_on_one_request_holds_no_other_clients_reply",)),
    Mutant("sampled-rows-share-a-generator", "the slots' next ids drawn together are each the id the one-row sampler draws alone "
           "(its own settings, ids so far and generator)",
           "model/generate.py", "generator=generators[r]))", "generator=generators[0]))",
           ("tests/test_serve.py::test_rows_sampled_together_draw_each_the_id_the_one_row_rule_draws_alone[1]",)),
    Mutant("batch-without-fixed-block", "a reply's bits do not depend on the replies decoded beside it (every linear through a fixed row block)",
           "model/decode.py", "    pad = -r % ROW_BLOCK\n", "    pad = 0\n",
           ("tests/test_serve.py::test_a_reply_is_the_same_bits_alone_and_among_1_3_and_7_others_of_other_lengths_joining_mid_way",)),
    Mutant("decode-attention-padded-to-the-batch", "a reply's bits do not depend on the replies decoded beside it (each sequence "
           "attends over its own keys, not over the batch's longest padded and masked)",
           "model/decode.py", "        y = torch.cat([F.scaled_dot_product_attention(q[s], keys[slot:slot + 1, :, :n], values[slot:slot + 1, :, :n])\n"
           "                       for s, (slot, n) in enumerate(zip(slots, ends))])\n",
           "        m = max(ends)\n        seen = (torch.arange(m) < torch.tensor(ends)[:, None])[:, None, :, None]\n"
           "        y = F.scaled_dot_product_attention(torch.cat(q), torch.where(seen, keys[where, :, :m], 0.0), "
           "torch.where(seen, values[where, :, :m], 0.0), attn_mask=seen.transpose(-1, -2))\n",
           ("tests/test_serve.py::test_a_reply_is_the_same_bits_alone_and_among_1_3_and_7_others_of_other_lengths_joining_mid_way",)),
    Mutant("kv-slot-never-freed", "a reply that ends gives its KV slot back to the server's pool",
           "model/decode.py", "            self.free.append(cache.slot)\n", "            pass\n",
           ("tests/test_serve.py::test_a_finished_replys_kv_slot_serves_the_next_and_the_replies_are_generate_ids_own",)),
    Mutant("kv-pool-failure-unnamed", "a KV pool the machine cannot hold is a command error naming --slots at the start, "
           "not a dead worker every request waits on",
           "cli/serve.py", "    except (RuntimeError, MemoryError) as e:  # torch's out-of-memory errors are RuntimeErrors\n",
           "    except MemoryError as e:\n",
           ("tests/test_serve.py::test_a_kv_pool_the_machine_cannot_hold_is_a_command_error_naming_slots_before_serving_not_a_dead_worker",)),
    Mutant("closed-generation-steps", "a generation that gave its KV slot back cannot step into the sequence that took it",
           "model/generate.py", "        self.closed = True\n", "        pass\n",
           ("tests/test_serve.py::test_a_closed_generation_cannot_step_into_the_slot_another_sequence_took_alone_or_together",)),
    Mutant("lone-generation-cache-at-full-context", "a lone generation's keys and values hold its own positions, not the model's context",
           "model/generate.py", "KVPool(model, 1, len(prompt) + max_new_tokens)", "KVPool(model)",
           ("tests/test_serve.py::test_a_lone_generations_cache_holds_its_own_positions_not_the_models_context_and_gives_the_pools_bits",)),
    Mutant("mix-not-furthest-behind", "a mix's next sample comes from the source furthest behind its share (Megatron's rule)",
           "data/mix.py", "        return errors.index(max(errors))\n", "        return errors.index(min(errors))\n",
           ("tests/test_mix.py::test_the_interleave_takes_the_next_sample_from_the_source_furthest_behind_its_share",)),
    Mutant("mix-source-one-epoch", "a mix's source that runs out reads its next epoch's order (seed + epoch)",
           "data/mix.py", "            epoch, p = divmod(first, self.sizes[k])\n", "            epoch, p = 0, first % self.sizes[k]\n",
           ("tests/test_mix.py::test_the_interleave_takes_the_next_sample_from_the_source_furthest_behind_its_share",)),
    Mutant("mix-sharded-by-rank", "a mix's micro-batch i of a step is computed by rank i mod W, on any world size",
           "data/mix.py", "            i = j * w + self.rank\n", "            i = self.rank * self.plan.accum + j\n",
           ("tests/test_mix.py::test_a_mix_halted_on_two_processes_and_resumed_on_three_is_the_run_on_one",)),
    Mutant("mix-phase-forgotten", "a resume with the same weights continues the phase its checkpoint holds",
           "data/mix.py", "            self.base_step, self.base = int(saved[\"base_step\"]), [int(saved[\"base\"][n]) for n in self.names]\n",
           "            self.base_step, self.base = step, list(counts)\n",
           ("tests/test_mix.py::test_weights_changed_and_a_source_added_on_a_resume_start_a_phase_equal_to_the_same_change_at_the_same_step",)),
    Mutant("mix-counts-reset", "a new phase keeps the counts consumed so far",
           "data/mix.py", "        self._steps, self.counts = {}, {step: counts}\n", "        self._steps, self.counts = {}, {step: [0] * len(counts)}\n",
           ("tests/test_mix.py::test_weights_changed_and_a_source_added_on_a_resume_start_a_phase_equal_to_the_same_change_at_the_same_step",)),
    Mutant("mix-removal-allowed", "removing a source on a resume is refused unless data.mix_drop names it",
           "data/mix.py", "        refused = [n for n in gone if n not in drop]\n", "        refused = []\n",
           ("tests/test_mix.py::test_a_source_removed_on_a_resume_is_refused_unless_data_mix_drop_names_it",)),
    Mutant("mix-chat-taught-by-rows", "a chat mix's step loss is over its taught tokens (I17), counted per source",
           "data/mix.py", "        return sum(self.parts[k].taught([i - self.order.offsets[k]]) for k, i in zip(self.source_of(indices), indices))\n",
           "        return len(indices) * self.seq_len\n",
           ("tests/test_mix.py::test_a_mix_of_one_source_is_the_run_on_that_corpus[chat]",)),
    Mutant("mix-val-tail-trained", "a mix's validation tails (data.val_samples of each source) are never in a training batch",
           "data/run.py", "        parts.append((name, kind(Path(p[\"bin\"]), seq_len, n - held, dtype=dtype)))\n",
           "        parts.append((name, kind(Path(p[\"bin\"]), seq_len, n, dtype=dtype)))\n",
           ("tests/test_mix.py::test_validation_holds_out_each_sources_tail_and_logs_each_sources_loss_the_same_on_any_world_size",)),
    Mutant("source-loss-rank-order", "a mix's loss/<name> sums every rank's rows in micro-batch order, the same on any world size",
           "objectives/next_token.py", "        rows = [row for _, part in sorted(pair for got in rt.all_gather(self.rows) for pair in got) for row in part]\n",
           "        rows = [row for _, part in (pair for got in rt.all_gather(self.rows) for pair in got) for row in part]\n",
           ("tests/test_mix.py::test_a_mix_halted_on_two_processes_and_resumed_on_three_is_the_run_on_one",)),
    Mutant("yarn-ramp-multiplies", "YaRN divides the ramped frequencies by factor, MiniMind-3's and transformers' formula",
           "model/model.py", "        inv = inv * (1 - ramp + ramp / factor)\n", "        inv = inv * (1 - ramp + ramp * factor)\n",
           ("tests/test_rope_scaling.py::test_minimind_s_own_model_with_inference_rope_scaling_gives_our_logits_from_its_pth", *("tests/test_rope_scaling.py::test_a_yarn_run_exported_to_hugging_face_gives_transformers_qwen3_logits_and_reads_back",))),
    Mutant("yarn-attention-factor-dropped", "YaRN multiplies cos and sin by attention_factor",
           "model/model.py", "        return emb.cos() * scaling[\"attention_factor\"], emb.sin() * scaling[\"attention_factor\"]\n",
           "        return emb.cos(), emb.sin()\n", ("tests/test_rope_scaling.py::test_a_yarn_run_exported_to_hugging_face_gives_transformers_qwen3_logits_and_reads_back",)),
    Mutant("rope-scaling-not-exported", "a Hugging Face export carries model.rope_scaling",
           "model/formats.py", "        **hf_yarn(cfg),\n", "", ("tests/test_rope_scaling.py::test_a_yarn_run_exported_to_hugging_face_gives_transformers_qwen3_logits_and_reads_back",)),
    Mutant("rope-scaling-not-compared", "model.init_from refuses a Hugging Face folder whose rope scaling is not model.rope_scaling",
           "model/formats.py", "    scaling, ours = hf_rope_scaling(hf), cfg.rope_scaling.act()\n", "    scaling, ours = None, None\n", ("tests/test_rope_scaling.py::test_a_yarn_run_exported_to_hugging_face_gives_transformers_qwen3_logits_and_reads_back",)),
    Mutant("repack-rereads-consumed", "data.resume_seq_len=repack reads the epoch's unread tokens, each once (issue 46)",
           "data/repack.py", "    unread[np.asarray(consumed, dtype=np.int64)] = False\n", "",
           ("tests/test_repack.py::test_the_remainder_is_every_unread_token_of_the_epoch_once_in_stream_order_cut_at_the_new_length",)),
    Mutant("repack-phase-not-carried", "a repacked epoch is read again by a later resume at the new seq_len, on any world size (issue 46)",
           "data/repack.py", "        return carried, None\n", "        return None, None\n",
           ("tests/test_repack.py::test_a_resume_at_a_longer_seq_len_is_a_new_phase_carried_to_a_resume_on_two_processes",)),
    Mutant("repack-reads-the-tail", "the remainder is what the epoch would still have read: not its tail that fills no global batch (issue 46)",
           "data/repack.py", "positions.take(0, record[\"consumed\"]) + positions.take(reads, n_old - reads)",
           "positions.take(0, record[\"consumed\"])",
           ("tests/test_repack.py::test_a_repack_at_the_epochs_end_is_an_empty_phase_and_the_next_epoch_reads_the_corpus_at_the_new_length",
            "tests/test_repack.py::test_a_resume_at_a_longer_seq_len_is_a_new_phase_carried_to_a_resume_on_two_processes")),
    Mutant("grpo-tokens-normalized-locally", "dapo/bnpo/TRL's cispo divide by the global batch's completion tokens, not a micro-batch's (issue 45)",
           "objectives/grpo.py", "return (per_token * m).sum() * micro_batches / denominator", "return (per_token * m).sum() / m.sum().clamp(min=1)",
           (FAMILY_REFEREE + "[dapo-token-group]",)),
    Mutant("grpo-batch-std-local", "scale_rewards=batch divides by the std of every rank's rewards (issue 45)",
           "objectives/grpo.py", "        if rescale and self.cfg.scale_rewards == \"batch\":", "        if False:",
           ("tests/test_grpo_family.py::test_batch_scaled_advantages_and_the_token_denominator_are_the_global_batchs",)),
    Mutant("grpo-denominator-not-restored", "a resume inside a rollout's updates divides by the same global token count (issue 45)",
           "objectives/grpo.py", "            self.grpo._globals(self.grpo.buffer, rescale=False)", "            pass",
           (FAMILY_CHAIN + "[dapo-batch-truncated]",)),
    Mutant("grpo-truncated-not-masked", "train.grpo.mask_truncated: a completion without an EOS takes no part in the loss (issue 45)",
           "objectives/grpo.py", "                if not (self.cfg.mask_truncated and c[\"truncated\"]):\n", "                if True:\n",
           (FAMILY_CHAIN + "[dapo-batch-truncated]",)),
    Mutant("gspo-ratio-per-token", "importance_sampling=sequence: the ratio of a sequence is exp of its mean log-ratio (GSPO, issue 45)",
           "objectives/grpo.py", "    if cfg.importance_sampling == \"sequence\":\n        m = mask.float()", "    if False:\n        m = mask.float()",
           (FAMILY_REFEREE + "[grpo-sequence-group]",)),
    Mutant("sapo-temperatures-swapped", "SAPO's temperature is sapo_tau_pos for positive advantages, sapo_tau_neg else (issue 45)",
           "objectives/grpo.py", "torch.where(a > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)", "torch.where(a > 0, cfg.sapo_tau_neg, cfg.sapo_tau_pos)",
           (FAMILY_REFEREE + "[sapo-token-none]",)),
    Mutant("ppo-gae-without-lambda", "PPO's advantages are GAE's, lambda-weighted, as MiniMind's train_ppo.py (issue 45)",
           "objectives/ppo.py", "last = delta + gamma * lam * last", "last = delta + gamma * last",
           (PPO_REFEREE,)),
    Mutant("ppo-value-unclipped", "PPO's value loss is clipped around the rollout's values, as MiniMind's (issue 45)",
           "objectives/ppo.py", "torch.max((values - returns) ** 2, (clipped - returns) ** 2)", "(values - returns) ** 2",
           (PPO_REFEREE,)),
    Mutant("ppo-steps-after-early-stop", "after PPO's early stop the rollout's later updates step no optimizer (MiniMind leaves its loop)",
           "objectives/ppo.py", "            self.skip_update = True\n", "            pass\n",
           ("tests/test_ppo.py::test_after_the_early_stop_fires_the_rollouts_later_updates_step_no_optimizer_as_minimind_leaves_its_loop",)),
    Mutant("ppo-critic-not-saved", "the critic and its optimizer are in the checkpoint: a resume goes on with them (issue 45)",
           "objectives/ppo.py", '        return {"critic": ModelState(self.critic), "critic_optimizer": OptimizerState(self.critic, self.critic_opt),\n',
           "        return {\n", (PPO_CHAIN,)),
    Mutant("ppo-critic-source-ignored", "train.ppo.critic: the critic starts from that source's weights (issue 45)",
           "objectives/ppo.py", "        if not resumed and self.ppo.critic:", "        if False:",
           ("tests/test_ppo.py::test_a_critic_from_a_weights_source_starts_from_it_and_one_of_another_tokenizer_is_refused",)),
    Mutant("ppo-early-stop-local", "early_stop_kl is decided on the global batch's approximate KL, the same on every world size (issue 45)",
           "objectives/ppo.py", "            for part in rt.all_gather(sums):", "            for part in [sums]:", (PPO_CHAIN,)),
    Mutant("ppo-whitened-locally", "PPO's advantages are whitened over the global batch's completion tokens (issue 45)",
           "objectives/ppo.py", "            order = sorted(merged)\n            adv = whiten(", "            merged = {i: merged[i] for i in mine}\n            order = sorted(merged)\n            adv = whiten(",
           (PPO_CHAIN,)),
    Mutant("agent-sampling-seeded-by-rank", "an episode's turn draws from (seed, step, prompt, r, turn)'s generator, whichever rank makes it (docs/rl.md)",
           "objectives/agent.py", "derive_seed(self.seed, STREAM, self.step, index, r, turn)", "derive_seed(self.seed, STREAM, self.step, index, r, turn, self.rt.rank)",
           (AGENT_CHAIN,)),
    Mutant("agent-mask-covers-tool-results", "an episode's loss mask covers the model's own ids, never a tool's result (docs/rl.md)",
           "objectives/agent.py", "            ids.extend(seen)\n", "            mine.extend(range(len(ids), len(ids) + len(seen)))\n            ids.extend(seen)\n",
           ("tests/test_agent.py::test_an_episodes_ids_are_the_models_turns_and_the_templates_tool_messages_and_only_the_models_ids_are_in_the_mask",)),
    Mutant("agent-observation-without-eos", "a turn cut by max_new_tokens is closed by the template's EOS before the tool messages",
           "objectives/agent.py", '("" if ended else eos_text) + tail', 'tail',
           ("tests/test_agent.py::test_an_episodes_ids_are_the_models_turns_and_the_templates_tool_messages_and_only_the_models_ids_are_in_the_mask",)),
    Mutant("agent-cut-not-unfinished", "a transcript that would fill model.seq_len is cut at a turn boundary and counted unfinished",
           "objectives/agent.py", "            if len(ids) + len(seen) >= seq_len:  # no position left to answer in: cut at this turn boundary\n                unfinished = True\n",
           "            if len(ids) + len(seen) >= seq_len:  # no position left to answer in: cut at this turn boundary\n                unfinished = False\n",
           ("tests/test_agent.py::test_an_episode_whose_tool_message_would_fill_model_seq_len_is_cut_at_the_turn_boundary_and_counted_unfinished",)),
    Mutant("agent-counts-not-saved", "a rollout under update keeps its episodes' counts in the resume state: the resumed run logs the same figures",
           "objectives/agent.py", 'KEYS = (*RolloutState.KEYS, "counts")', "KEYS = RolloutState.KEYS", (AGENT_CHAIN,)),
    Mutant("agent-tool-hash-unchecked", "a changed tool file is refused on resume naming both hashes",
           "objectives/agent.py", "        if resumed and meta.reward:\n", "        if False:\n",
           ("tests/test_agent.py::test_a_changed_tool_file_is_refused_on_resume_naming_both_hashes",)),
    Mutant("calculate-math-eval", "calculate_math evaluates the model's text as bounded arithmetic, never with eval",
           "objectives/tools.py", 'return {"result": str(arithmetic(expr.replace("（", "(").replace("）", ")")))}',
           'return {"result": str(eval(expr.replace("（", "(").replace("）", ")"), {"__builtins__": {}, "math": math}))}',
           ("tests/test_agent.py::test_calculate_math_evaluates_arithmetic_as_python_does_and_gives_minimind_s_error_for_anything_else_or_too_large",)),
    Mutant("agent-tool-timeout-ignored", "a tool call is bounded by train.agent.tool_timeout_s",
           "objectives/tools.py", "result = fn.call((args,), {}, self.timeout_s, RESULT_CHARS)", "result = fn.call((args,), {}, None, RESULT_CHARS)",
           ("tests/test_agent.py::test_a_users_tool_is_pinned_by_its_file_hash_a_raising_one_reads_the_error_and_a_slow_one_fails_at_its_timeout",)),
    Mutant("agent-raising-tool-crashes", "a tool that raises gives the model MiniMind's error message, not a crash",
           "objectives/tools.py", "        except Exception:  # noqa: BLE001 - MiniMind's rule", "        except KeyError:  # noqa: BLE001 - MiniMind's rule",
           ("tests/test_agent.py::test_the_six_mock_tools_answer_as_minimind_s_and_a_raising_or_unknown_tool_reads_its_error_message",)),
    Mutant("agent-reward-tags-unpenalized", "MiniMind's agent reward: -0.5 per unbalanced <tool_call> tag (as train_agent.py)",
           "objectives/tools.py", 'reward = -0.5 * sum(abs(a.count("<tool_call>")', 'reward = -0.0 * sum(abs(a.count("<tool_call>")',
           ("tests/test_agent.py::test_parsed_calls_and_rewards_equal_minimind_train_agent_on_the_same_transcripts",)),
    Mutant("agent-tool-schema-unchecked", "a malformed tool schema is refused naming the line",
           "data/agent.py", 'elif not isinstance(fn.get("name"), str) or not fn["name"].strip():', "elif False:",
           ("tests/test_agent.py::test_a_malformed_tool_schema_or_gt_is_refused_naming_the_line",)),
    Mutant("ddp-keyword-of-a-newer-torch", "every API the code calls exists in the oldest supported torch (common/versions.py) (I32)",
           "runtime/reduce.py", "DDP(model, device_ids=ids, broadcast_buffers=False)", "DDP(model, device_ids=ids, forward_sync_buffers=False)",
           ("tests/test_torch_range.py::test_on_the_oldest_torch_a_run_halted_and_resumed_on_several_processes_is_the_uninterrupted_run",)),
    Mutant("torch-range-unchecked", "a launch on a torch outside the supported range stops with one line, exit 2 (I32)",
           "common/versions.py", "    if got is not None and OLDEST <= got <= NEWEST:\n", "    if True:\n",
           ("tests/test_torch_range.py::test_a_launch_on_a_torch_outside_the_range_stops_before_any_work_with_one_line_and_exit_2",)),
    Mutant("inductor-deterministic-always", "runtime.deterministic=false on CUDA pays for no deterministic mode (I26, I32)",
           "runtime/speed.py", "    deterministic_mode = deterministic or device == \"cpu\"\n", "    deterministic_mode = True\n",
           ("tests/test_compile.py::test_a_compiled_run_pays_for_inductors_deterministic_mode_only_where_its_exactness_needs_it",)),
    Mutant("loss-read-every-step", "a step's loss stays on the device until a log step or a checkpoint (I32)",
           "runtime/reduce.py", "        return mean_over_ranks(local, self.rt)\n", "        return float(mean_over_ranks(local, self.rt))\n",
           ("tests/test_host_reads.py::test_a_steps_loss_is_read_to_the_host_only_at_log_steps_checkpoints_and_the_end",)),
    Mutant("io-failure-as-bad-input", "an out_dir the run cannot write (read-only, permission denied) is an I/O failure, exit 1 naming the path (I16)",
           "run/folder.py", 'str(e), outcome_of(e) == "bad_input")', "str(e), True)",
           ("tests/test_run_folder.py::test_an_out_dir_that_cannot_be_written_is_an_io_failure_exit_1_naming_the_path_in_the_trainer_and_"
            "the_launcher[train.py-held-a-run-read-only]",)),
    Mutant("mix-weights-sum-overflows", "mix weights are normalized without overflow (1e308 and 9e307 are 10/19 and 9/19) (docs/data.md)",
           "data/mix.py", "    scale = 2.0 ** -math.frexp(max(weights))[1]\n", "    scale = 1.0\n",
           ("tests/test_mix.py::test_weights_whose_sum_overflows_a_float_are_normalized_to_their_shares_and_interleave_as_those_shares_do",)),
    Mutant("tool-finds-the-checkpoint-twice", "a tool's model and tokenizer come from one checkpoint, found and named once",
           "weights/ours.py", "    return load_model(folder, device, dtype, fp32), load_tokenizer(folder)\n",
           "    return load_model(path, device, dtype, fp32), load_tokenizer(path)\n",
           ("tests/test_edges.py::test_the_tools_name_the_checkpoint_they_used_and_a_newer_one_skipped_as_damaged_once_each",)),
    Mutant("referee-skipped-under-ci", "under CI=true a test whose MiniMind referee is missing fails instead of skipping (docs/tests.md)",
           "tests/conftest.py", '            if os.environ.get("CI") == "true":\n                pytest.fail(f"{why}',
           '            if False:\n                pytest.fail(f"{why}',
           ("tests/test_first_hour.py::test_the_referee_tests_fail_under_ci_where_minimind_s_code_is_missing_and_skip_elsewhere",)),
    Mutant("unit-draws-without-its-font-cache", "the unit tier passes where matplotlib never ran: its font cache is built before the guard (docs/tests.md)",
           "tests/test_distill.py", "_the_run_does_not_log(tmp_path, matplotlib_ready):", "_the_run_does_not_log(tmp_path):",
           ("tests/test_first_hour.py::test_the_unit_tier_draws_on_a_machine_where_matplotlib_never_ran",)),
    Mutant("objective-unread-key-accepted", "a key of an objective's section that the chosen objective does not read, set away from its default, "
           "is refused naming it (issue 58)",
           "objectives/spec.py", '            if key.split(".")[2] not in honoured and value != default:\n', "            if False:\n",
           ("tests/test_objectives.py::test_a_key_an_objective_does_not_read_set_away_from_its_default_is_refused_naming_it_under_every_objective",)),
    Mutant("agent-advantages-unscaled", "the agent's advantages take train.grpo.scale_rewards and std: GRPO's one rollout path (issue 58)",
           "objectives/grpo.py", '"advantages": advantages(r, g, self.cfg.scale_rewards, self.cfg.std == "sample", r)', '"advantages": advantages(r, g)',
           ("tests/test_objectives.py::test_the_agents_scale_rewards_std_and_mask_truncated_train_and_halted_on_2_resumed_on_3_equal_the_1_process_run"
            "[scale_rewards-none]",)),
    Mutant("store-cache-fetched-unverified", "a packed file fetched from a cache in the store is used only when its sha256 is the record's (I20, I33)",
           "common/store.py", "                if h.hexdigest() != sha256:\n                    raise _Mismatch\n",
           "                if False:\n                    raise _Mismatch\n",
           ("tests/test_object_storage_data.py::test_a_packed_side_file_whose_bytes_changed_in_the_store_is_refused_as_it_comes_down_"
            "packed_again_and_put_back",)),
    Mutant("store-chunk-unverified", "a chunk of the packed rows read from the store is used only when its sha256 is the record's (I20, I33)",
           "data/chunked.py", "            if got != want:\n", "            if False:\n",
           ("tests/test_object_storage_data.py::test_a_chunk_whose_bytes_changed_in_the_store_is_named_when_a_row_of_it_is_read_and_"
            "never_used",)),
    Mutant("store-client-shared-after-fork", "a forked DataLoader worker reads the store through a client of its own, not its parent's (I33)",
           "common/store.py", "os.register_at_fork(after_in_child=_own_clients_after_fork)\n", "pass\n",
           ("tests/test_object_storage_data.py::test_dataloader_workers_fetch_chunks_with_clients_of_their_own_and_a_damaged_one_is_named_"
            "in_one_line",)),
    Mutant("store-chunk-damage-in-a-worker-traceback", "an error met in a DataLoader worker (a damaged chunk, the store down) is one line naming the object (I33)",
           "run/protocol.py", '    if message.startswith("Caught ") and " in DataLoader worker process " in message:\n', "    if False:\n",
           ("tests/test_object_storage_data.py::test_dataloader_workers_fetch_chunks_with_clients_of_their_own_and_a_damaged_one_is_named_"
            "in_one_line", "tests/test_protocol.py::test_an_error_a_dataloader_worker_raised_is_said_in_its_own_one_line_not_the_workers_traceback")),
    Mutant("store-cache-fetched-whole", "a fresh node reads the packed rows from the store a chunk at a time as it reads rows, not the whole file (I33)",
           "data/prepare.py", '            if "chunks" in entry:  #', '            if False:  #',
           ("tests/test_object_storage_data.py::test_a_fresh_nodes_packed_rows_come_from_the_store_a_chunk_at_a_time_as_they_are_read_"
            "and_equal_a_local_caches",)),
    Mutant("store-cache-ignored", "a fresh node fetches the packed cache from the store: it neither reads the corpus nor packs it again (I20, I33)",
           "data/prepare.py", '    got = store.get(key(f"{stem}.json"))\n', "    got = None\n",
           ("tests/test_object_storage_data.py::test_a_fresh_node_with_the_corpus_and_its_packed_cache_in_the_store_neither_reads_the_"
            "corpus_nor_packs_and_ends_on_the_same_bits",)),
    Mutant("store-table-kept-local", "with the cache in the store the precomputed tables live there too: a fresh node recomputes nothing (I31, I33)",
           "objectives/tables.py", "    return StoreTableFiles(url) if url else TableFiles(folder)\n", "    return TableFiles(folder)\n",
           ("tests/test_object_storage_data.py::test_dpos_table_lives_beside_the_packed_rows_in_the_store_a_fresh_node_recomputes_nothing_"
            "and_a_damaged_chunk_is_computed_again",)),
    Mutant("ft-micro-batch-by-rank", "under live recovery micro-batch i of step s goes to a participant by a pure function of (s, i, participants) (I34)",
           "runtime/ft.py", "        self.mine = self.share[self.group][self.rt.rank :: self.rt.world_size]\n",
           "        self.mine = [j * len(participants) + self.rt.rank for j in range(len(self.share[self.group]))]\n",
           ("tests/test_ft.py::test_shrink_the_writer_group_sigkilled_for_good_the_two_others_end_bit_identical_to_one_process",)),
    Mutant("ft-divided-by-participants", "the groups' gradient sum is divided by the micro-batches of the step, never by the participants (I34)",
           "runtime/ft.py", "        total /= self.m\n", "        total /= len(self.participants)\n",
           ("tests/test_ft.py::test_shrink_the_writer_group_sigkilled_for_good_the_two_others_end_bit_identical_to_one_process",)),
    Mutant("ft-heal-without-cursor", "a healed group takes the data cursor from its peer and reads the step's batch after the heal (I34)",
           "run/live.py", "            obj.load_state_dict(payload[\"states\"][name])\n",
           "            obj.load_state_dict(payload[\"states\"][name]) if name != \"train\" else None\n",
           ("tests/test_ft.py::test_heal_a_group_sigkilled_and_relaunched_heals_from_a_live_peer_and_ends_bit_identical",)),
    Mutant("ft-heal-identity-unchecked", "a healed group checks the model's identity and the optimizer state's hash against the sender's (I34)",
           "run/live.py", "        self.verify(payload, sender)\n", "        pass\n",
           ("tests/test_ft.py::test_a_heal_whose_weights_do_not_arrive_as_sent_is_refused_naming_the_identity",)),
    Mutant("orpo-nll-over-the-ranks-tokens", "ORPO's NLL is divided by the global batch's chosen tokens, not one rank's (issue 58)",
           "objectives/orpo.py", "        self.tokens = sum(n for part in rt.all_gather(mine) for n in part.values())\n",
           "        self.tokens = sum(mine.values())\n",
           ("tests/test_orpo.py::test_orpo_halted_on_2_processes_and_resumed_on_3_equals_the_one_process_run",)),
    Mutant("kto-kl-over-the-micro-batch", "KTO's KL term is the global batch's, not one micro-batch's (TRL's is a device's) (issue 58)",
           "objectives/kto.py", "        kl = self.kl.to(device)  # the global batch's (prepare)\n",
           "        kl = torch.tensor(max(self.local[i][0] / self.local[i][1], 0.0)).to(device)\n",
           ("tests/test_kto.py::test_the_kl_term_and_the_mean_are_the_global_batchs_whatever_the_micro_batch",)),
)

def copy_repository(dest: Path) -> None:
    """The files git would commit (tracked, and untracked but not ignored); ../shared beside it."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    shared = ROOT.parent / "shared"
    if shared.is_dir():
        (dest.parent / "shared").symlink_to(shared, target_is_directory=True)


def oldest_torch() -> dict:
    """The oldest supported torch's python of this checkout, for tests/test_torch_range.py in the copy."""
    py = ROOT / ".venv" / "torch-oldest" / "bin" / "python"
    return {"MINIMIND_OLDEST_PYTHON": str(py)} if py.exists() and "MINIMIND_OLDEST_PYTHON" not in os.environ else {}


def pytest(repo: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfEs", "-p", "no:cacheprovider", "-o", "addopts=", *tests]
    try:
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **oldest_torch()})
    except subprocess.TimeoutExpired as e:
        return None, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    return proc.returncode, proc.stdout + proc.stderr


def invariant_table() -> str:
    """docs/design.md's table: each invariant of docs/design.md that a mutant breaks (the "(In)" tag of
    its promise), with those mutants and the tests that catch them."""
    by: dict[int, list[Mutant]] = {}
    for m in MUTANTS:
        tag = re.search(r"\((I\d+(?:, I\d+)*)\)$", m.promise)
        for n in re.findall(r"I(\d+)", tag.group(1)) if tag else ():
            by.setdefault(int(n), []).append(m)
    rows = ["| invariant | mutants | caught by |", "|---|---|---|"]
    for n in sorted(by):
        tests = dict.fromkeys(t.removeprefix("tests/").split("::")[0] for m in by[n] for t in m.tests)
        rows.append(f"| I{n} | {', '.join(f'`{m.name}`' for m in by[n])} | {', '.join(f'`{t}`' for t in tests)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the mutants and their tests, run nothing")
    parser.add_argument("--markdown", action="store_true", help="print the mutants as docs/tests.md's table, run nothing")
    parser.add_argument("--invariants", action="store_true", help="print docs/design.md's table: each invariant, its mutants, their tests")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the tests")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run (a hang counts as not caught)")
    a = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not a.only or m.name in a.only]
    unknown = set(a.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        print(f"mutants: unknown mutant(s) {', '.join(sorted(unknown))}; --list shows them", file=sys.stderr)
        return 2
    if a.list:
        for m in chosen:
            print(f"{m.name:28} {m.file:24} {m.promise}\n{'':28} tests: {', '.join(m.tests)}")
        return 0
    if a.invariants:
        print(invariant_table())
        return 0
    if a.markdown:
        print("| mutant | file | the promise it breaks | caught by |\n|---|---|---|---|")
        for m in chosen:
            tests = "<br>".join(f"`{t.removeprefix('tests/')}`" for t in m.tests)
            print(f"| `{m.name}` | `{m.file}` | {m.promise.replace('|', '/')} | {tests} |")
        return 0

    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        copy_repository(repo)
        for m in chosen:  # every mutant must fit the code before any runs
            count = (repo / m.file).read_text().count(m.old)
            if count != 1:
                print(f"mutants: {m.name}: its text occurs {count} times in {m.file} (expected once): the mutant no longer fits the code",
                      file=sys.stderr)
                return 2
        t0 = time.monotonic()
        if not a.no_baseline:
            tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            code, out = pytest(repo, tests, a.timeout)
            if code != 0:
                print(f"mutants: the tests fail without any mutant (exit {code}); nothing is proved:\n{out[-4000:]}", file=sys.stderr)
                return 2
            if skipped := re.findall(r"^SKIPPED .*$", out, flags=re.M):
                print(f"mutants: {len(skipped)} of the tests skip without any mutant, so nothing they would catch is proved "
                      f"(install what they need, or give --only):\n" + "\n".join(skipped[:10]), file=sys.stderr)
                return 2
            print(f"baseline: {len(tests)} tests pass unmutated ({time.monotonic() - t0:.0f} s)", flush=True)
        survived, unproved = [], 0
        for m in chosen:
            path = (repo / m.file)
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new))
            t1 = time.monotonic()
            try:
                code, out = pytest(repo, m.tests, a.timeout)
            finally:
                path.write_text(original)
            verdict = judge(code, out)
            if not verdict.startswith("caught"):
                survived.append(m.name)
                unproved += verdict.startswith("NOT PROVED")
            print(f"{m.name:28} {verdict}  [{time.monotonic() - t1:.0f} s]", flush=True)
        print(f"{len(chosen) - len(survived)} of {len(chosen)} mutants caught in {time.monotonic() - t0:.0f} s")
    return 2 if unproved else 1 if survived else 0


def judge(code: int | None, out: str) -> str:
    """A mutant's verdict from its pytest run: "caught by <test>" only for a test that ran and
    failed; "NOT PROVED" when its tests were skipped (a skip proves nothing: the script fails, exit 2);
    else "SURVIVED", with why when no test failed for another reason."""
    failed = re.findall(r"^FAILED (\S+)", out, flags=re.M)
    errors = re.findall(r"^ERROR (\S+)", out, flags=re.M)
    skipped = re.findall(r"^SKIPPED \[\d+\] (\S+)", out, flags=re.M)
    if code == 1 and failed and not errors:  # a test that ran and failed; an error in collection or a fixture proves nothing
        return f"caught by {failed[0]}"
    if skipped and not failed:
        return f"NOT PROVED ({len(skipped)} test(s) skipped, e.g. {skipped[0]})"
    if code == 0:
        return "SURVIVED"
    why = f"{len(errors)} collection or fixture error(s), e.g. {errors[0]}" if errors else \
        f"pytest {'timed out' if code is None else f'exit {code}'}, no test failed"
    return f"SURVIVED ({why})"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from common.outcome import command

    sys.exit(command(main))
