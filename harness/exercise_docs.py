"""The docstring each replaced function carries in a practice exercise.

A fault's own docstring says what is wrong (it serves ``faultbench show``), and the seam's docstring
states the clean contract, which the buggy body often contradicts ("with PyTorch SDPA" above a
hand-written softmax): either would point at the changed function. The least leaky choice is what the
buggy code's author would have written: the intent, in words that fit the body's form, with no hint of
the mistake. ``AUTHOR_DOCS`` holds that docstring per fault and seam (None: the author wrote none);
``STALE_DOCSTRING`` lists the few faults where a stale contract above a rewritten body is the clue the
exercise deliberately keeps (the seam's docstring stays). Every reference fault is in exactly one of them.
"""

from __future__ import annotations

STALE_DOCSTRING = frozenset({
    "softmax_in_fp16",  # "with PyTorch SDPA" above a hand-written softmax: a refactor that forgot its docstring
    "probs_then_log_softmax",  # "Next-token logits." above a forward that now returns probabilities
})

# {fault id: docstring} for a one-seam fault, {fault id: {seam: docstring}} for a fault spanning seams
AUTHOR_DOCS: dict[str, str | None | dict[str, str | None]] = {
    "accumulation_mean_per_micro_batch": "Autocast forward of one micro-batch and its mean next-token loss.",
    "adam_betas_swapped": "AdamW with two groups: weight decay on 2-D weight matrices; none on biases, norms and "
                          "embeddings.",
    "amp_no_scaling": "A GradScaler for half-precision training (bf16 needs none).",
    "attention_mask_inverted": "Pad a list of token-id documents into a batch (input_ids, attention_mask, "
                               "position_ids, labels).",
    "causal_mask_transposed": "Additive mask combining causality and padding; None when causal suffices.",
    "clip_before_backward": "One optimizer step over an accumulation window of micro-batches.",
    "collate_pads_to_max_length": "Pad a list of token-id documents into a fixed-shape batch.",
    "cpu_rng_restored_only_with_cuda": "Put back the RNG states ``capture_rng_state`` recorded.",
    "ddp_double_reduction": "DDP communication hook: average one bucket of flattened gradients over the ranks.",
    "eval_in_train_mode": "Mean next-token cross-entropy (nats per predicted token) over ``docs``.",
    "eval_loss_over_pads": "Mean next-token cross-entropy over ``docs``, batch by batch.",
    "fp16_mask_constant": {
        "model.attention.build_attention_mask": "Additive mask combining causality and padding (the dtype's "
                                                "most negative value on masked entries); None when causal "
                                                "suffices.",
        "model.attention.attend": "softmax(q k^T / sqrt(hs) + mask) v, written out.",
    },
    "head_not_tied": "N(0, init_std) weights and zero biases; residual output projections scaled by "
                     "1/sqrt(2 n_layer).",
    "huge_lr": "Learning rate of optimizer step ``step`` (0-based): warmup, then cosine to ``min_lr``.",
    "ignore_index_mismatch": "Next-token cross-entropy over the non-ignored labels, divided by ``num_targets``.",
    "init_std_too_large": "Normal init for the weights, zero biases; residual projections scaled down.",
    "kv_cache_wrong_index": "Write k, v (B, nh, T, hs) into the layer's cache; return all cached (B, nh, len, hs).",
    "label_permute": "Autocast forward of one micro-batch (rows sorted by length); its share of the window's "
                     "token-mean loss.",
    "label_shift_off_by_one": "Summed cross-entropy of the logits against ``labels``, divided by ``num_targets``.",
    "labels_misaligned_by_pad_count": "Pad a list of token-id documents into a batch.",
    "labels_not_ignored_on_pads": "Pad a list of token-id documents into a batch; pads use ``pad_id``.",
    "labels_shifted_twice": "Autocast forward of one micro-batch against its next-token labels; its share of "
                            "the window's token-mean loss.",
    "loss_history_keeps_graph": "One optimizer step over an accumulation window; the step's loss goes to the "
                                "record.",
    "loss_scaled_twice": "One optimizer step over an accumulation window, the loss scaled for fp16.",
    "loss_sum_reduction": "Next-token cross-entropy of ``logits`` against ``labels``.",
    "lr_lambda_absolute": "A LambdaLR following ``lr_at``; call ``step()`` once per optimizer step.",
    "lr_schedule_horizon_wrong": {
        "model.train.train_step": "One optimizer step over an accumulation window of micro-batches, the "
                                  "schedule advanced as they go.",
        "model.train.optimizer_step": "Step through the scaler, update the scale, clear gradients.",
    },
    "mask_dtype_unpadded": "Pad a list of token-id documents into a batch; the mask marks the pads (None when "
                           "nothing is padded).",
    "mask_keep_convention_in_attention": "softmax(q k^T / sqrt(hs)) v with the mask applied to the scores.",
    "missing_bos": None,
    "missing_unscale_before_clip": "Clip the gradients to ``max_norm`` (0: no clipping); returns their total "
                                   "norm.",
    "missing_zero_grad": "Step through the scaler, update the scale, advance the schedule.",
    "no_causal_mask": "softmax(q k^T / sqrt(hs) + mask) v with PyTorch SDPA; None mask: nothing to hide.",
    "no_sync_on_last_micro_batch": "Wrap a micro-batch's forward and backward: gradients are reduced on the "
                                   "inner micro-batches.",
    "only_rank0_loads_checkpoint": "Restore the run's full state from ``directory`` (rank 0 reads the weights); "
                                   "raises ``CheckpointError`` on any mismatch.",
    "optimizer_state_not_restored": "Restore the run's weights, schedule and progress from ``directory``; "
                                    "raises ``CheckpointError`` on any mismatch.",
    "overlong_document_skips_truncation": "Cut ``ids`` to at most ``max_len`` tokens, plus the final EOS.",
    "pad_id_mismatch": "The next global batch from the sampler, split into ``accum`` micro-batches padded with "
                       "the vocabulary's pad id.",
    "padding_mask_broadcast_over_query": "Additive mask combining causality and padding; None when causal "
                                         "suffices.",
    "padding_mask_dropped": "Additive causal mask for the queries over the keys; None when causal suffices.",
    "params_missing_from_optimizer": "AdamW with weight decay on the 2-D weight matrices.",
    "residual_norm_order": "Pre-norm block: attention then MLP, each added to the residual stream.",
    "rope_past_len_drift": "Positions of the tokens after the first ``past_len`` columns.",
    "rope_q_only": "x: (B, T, C) -> (B, T, C). rope: (cos, sin) of each token's position.",
    "rope_rotation_sign": "Rotate channel pairs (i, i + hs/2) of ``x`` by each token's position angle.",
    "rope_table_one_short": "cos and sin tables for ``max_positions`` positions, each (n, head_dim // 2), "
                            "float32.",
    "sampler_ignores_rank": "This rank's dataset indices for the next global batch; rolls over to the next "
                            "epoch.",
    "sampler_state_not_restored": "Restore the run's model, optimizer, schedule and scaler from ``directory``; "
                                  "raises ``CheckpointError`` on any mismatch.",
    "scaler_update_never_called": "Step through the scaler, advance the schedule, clear gradients.",
    "scheduler_state_not_restored": "Restore the run's model, optimizer, scaler and data position from "
                                    "``directory``; raises ``CheckpointError`` on any mismatch.",
    "softmax_wrong_axis": "softmax(q k^T / sqrt(hs) + mask) v, written out.",
    "step_off_by_one_on_resume": "Restore the run's full state from ``directory`` and continue after the saved "
                                 "step; raises ``CheckpointError`` on any mismatch.",
    "truncation_drops_eos": "Cut ``ids`` to ``max_len`` tokens.",
    "val_split_overlaps_train": "``\"val\"`` with probability ``val_fraction``, else ``\"train\"``.",
    "zero_clip_local_norm": "Clip the gradients this rank's optimizer updates to ``max_norm`` (0: no clipping); "
                            "returns their norm.",
    "zero_grad_between_backward_and_step": "Clear the gradients, step through the scaler, update the scale, "
                                           "advance the schedule.",
}


def exercise_docstring(fault_id: str, seam: str, seam_doc: str | None) -> str | None:
    """The docstring ``seam`` carries in an exercise of ``fault_id``: the author's, or the seam's own where the
    fault keeps a stale one on purpose. A fault in neither table (a plugin's) gets no docstring: a missing
    docstring is a weaker clue than a contradicting one."""
    if fault_id in STALE_DOCSTRING:
        return seam_doc
    doc = AUTHOR_DOCS.get(fault_id)
    return doc.get(seam) if isinstance(doc, dict) else doc
