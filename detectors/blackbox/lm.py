"""The user's model seen only as a causal LM: logits for token ids, whatever its call convention.

``CausalLM.wrap(model)`` reads the names ``forward`` accepts and makes one trial call on a 1x2 batch to
learn how to get per-position logits out of it:
- HF style: ``model(input_ids=..., attention_mask=..., position_ids=..., past_key_values=..., use_cache=...)``
  returning an object with ``.logits``;
- nanoGPT style: ``model(idx)`` returning ``(logits, loss)`` (or only the last position's logits unless
  ``targets`` are given: then the trial passes them and the loss is ignored);
- a plain ``model(idx) -> logits`` tensor.
Nothing here knows any model's attribute names: only the call signature and what the call returns.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch

from faultbench.detectors.api import traceless


def _accepted(model: torch.nn.Module) -> frozenset[str]:
    """The keyword names ``model.forward`` declares (``**kwargs`` does not count: it promises nothing)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def _required_besides_ids(model: torch.nn.Module) -> list[str]:
    """The parameters ``model.forward`` requires (no default) besides the first, which takes the ids: a forward
    that needs them (a decoder input, the targets) is not a causal LM called on ids alone."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params[1:] if p.kind in kinds and p.default is inspect.Parameter.empty]


def _first_logits(out, batch: int, length: int) -> torch.Tensor | None:
    """The (B, T', V) floating tensor in a forward's return value (T' = ``length`` or 1; any when ``length`` < 0):
    ``.logits``, the first such tensor of a tuple/list, or the tensor itself; None when there is none."""
    candidates = [getattr(out, "logits", None)]
    candidates += list(out) if isinstance(out, (tuple, list)) else [out]
    for c in candidates:
        if isinstance(c, torch.Tensor) and c.is_floating_point() and c.dim() == 3 and c.shape[0] == batch:
            if length < 0 or c.shape[1] in (length, 1):
                return c
    return None


@contextlib.contextmanager
def quiet(model: torch.nn.Module):
    """No grad, eval mode, every torch RNG (CPU and the model's device) restored: a side-effect-free call."""
    was_training = model.training
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model.eval()
        try:
            yield
        finally:
            model.train(was_training)


@dataclass
class CausalLM:
    """The user's model as a causal LM. ``by_name``: ids go in as ``input_ids=`` (HF) rather than positionally;
    ``pass_targets``: the model returns every position's logits only when given targets (nanoGPT)."""

    model: torch.nn.Module = field(repr=False)
    takes_attention_mask: bool = False
    takes_position_ids: bool = False
    takes_cache: bool = False
    by_name: bool = False
    pass_targets: bool = False
    label_name: str | None = None  # the keyword its forward takes labels by ("labels", nanoGPT's "targets")
    unpadded_error: Exception | None = field(default=None, repr=False)  # the trial call raised unpadded, not padded

    @classmethod
    def wrap(cls, model: torch.nn.Module) -> CausalLM:
        """Learn ``model``'s call convention from its signature and one trial call on a 1x2 batch of ids 0, 1.
        Raises ValueError (one line) when no call gives per-position logits. A model that raises on that call but
        runs on a left-padded batch with a mask is wrapped, its error kept in ``unpadded_error`` (a probe's finding).
        """
        required = _required_besides_ids(model)
        if required:  # the probes would call it without them: it is not probed, it is not broken
            raise ValueError(f"{type(model).__name__}.forward requires {', '.join(required)} besides the token ids: "
                             "it is not called as a causal LM on ids alone")
        names = _accepted(model)
        lm = cls(model, takes_attention_mask="attention_mask" in names, takes_position_ids="position_ids" in names,
                 takes_cache={"past_key_values", "use_cache"} <= names, by_name="input_ids" in names,
                 label_name=next((n for n in ("labels", "targets") if n in names), None))
        ids = torch.tensor([[0, 1]], device=lm.device)
        with quiet(model):
            try:
                out = lm._call(ids)
            except Exception as exc:  # noqa: BLE001 - a model broken on the plainest call: try it padded
                if not lm.takes_attention_mask:
                    raise
                ids, mask = torch.tensor([[0, 1, 1], [0, 0, 1]], device=lm.device), torch.tensor([[1, 1, 1], [0, 1, 1]])
                lm.check_logits(_first_logits(lm._call(ids, attention_mask=mask.to(lm.device)), 2, 3), 3)
                lm.unpadded_error = traceless(exc)
                return lm
            logits = _first_logits(out, 1, 2)
            if logits is not None and logits.shape[1] != 2 and "targets" in names:
                lm.pass_targets = True
                logits = _first_logits(lm._call(ids), 1, 2)
        lm.check_logits(logits, 2)
        return lm

    def check_logits(self, logits: torch.Tensor | None, length: int) -> None:
        if logits is None or logits.shape[1] != length:
            raise ValueError(f"{type(self.model).__name__} gives no (batch, time, vocab) logits for a batch of ids")

    @property
    def device(self) -> torch.device:
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    def _call(self, input_ids: torch.Tensor, **kwargs):
        """One forward in the model's convention; ``kwargs`` only holds names the model declares."""
        if self.pass_targets:
            kwargs.setdefault("targets", input_ids)
        if self.by_name:
            return self.model(input_ids=input_ids, **kwargs)
        return self.model(input_ids, **kwargs)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) -> float logits (B, T, V). ``attention_mask`` / ``position_ids`` (B, T) are passed
        only when given; a model that does not take them raises ValueError rather than ignoring them."""
        return self.raw_logits(input_ids, attention_mask, position_ids).float()

    def raw_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``logits`` in the dtype the model computed them in (float64 in a full-precision probe)."""
        kwargs = self._extras(attention_mask, position_ids)
        return _first_logits(self._call(input_ids, **kwargs), *input_ids.shape)

    def logits_given_labels(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """float logits (B, T, V) of a forward handed ``labels`` (B, T) by the model's own label keyword (its loss
        computed on the side); ValueError when it takes none."""
        if self.label_name is None:
            raise ValueError("the model takes no labels")
        kwargs = self._extras(None, None) | {self.label_name: labels}
        return _first_logits(self._call(input_ids, **kwargs), *input_ids.shape).float()

    def _extras(self, attention_mask, position_ids) -> dict:
        extras = {"attention_mask": (attention_mask, self.takes_attention_mask),
                  "position_ids": (position_ids, self.takes_position_ids)}
        kwargs = {}
        for name, (value, taken) in extras.items():
            if value is None:
                continue
            if not taken:
                raise ValueError(f"the model takes no {name}")
            kwargs[name] = value
        if self.takes_cache:
            kwargs["use_cache"] = False  # a full forward: no cache built on the side
        return kwargs

    def decode_with_cache(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                          prefill: int = 1) -> torch.Tensor | None:
        """input_ids (B, T) through the model's own KV cache (``use_cache=True``, ``past_key_values`` handed back
        each call): the first ``prefill`` tokens in one call, then one token at a time -> float logits (B, T, V);
        None when the model takes no cache. Positions are left to the model (as its own decoding does): only
        the growing mask is passed."""
        if not self.takes_cache:
            return None
        past, steps, bounds = None, [], [0, *range(max(1, prefill), input_ids.shape[1] + 1)]
        for start, stop in zip(bounds, bounds[1:], strict=False):
            kwargs = {"use_cache": True, "past_key_values": past}
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask[:, :stop]
            out = self._call(input_ids[:, start:stop], **kwargs)
            past = getattr(out, "past_key_values", None)
            if past is None:
                return None  # it accepted the names but hands no cache back
            steps.append(_first_logits(out, input_ids.shape[0], stop - start).float())
        return torch.cat(steps, dim=1)

    @property
    def has_generate(self) -> bool:
        """Whether the model has its own ``generate`` taking ``max_new_tokens`` (its decode loop, its cache)."""
        generate = getattr(self.model, "generate", None)
        if not callable(generate):
            return False
        names = _accepted_fn(generate)
        return "max_new_tokens" in names or "generation_config" in names

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, new_tokens: int = 8
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Greedy decoding through the model's own ``generate`` (its cache, its decode positions) ->
        (sequences (B, T + new_tokens), the raw logits each decode call gave for its last position
        (B, new_tokens, V) float, caught by a forward hook on the model); None when the model has no ``generate``
        or it returns no sequence of that length."""
        steps: list[torch.Tensor] = []

        def catch(module, args, output):
            logits = _first_logits(output, input_ids.shape[0], -1)
            if logits is not None:
                steps.append(logits[:, -1].float())

        handle = self.model.register_forward_hook(catch)
        try:
            sequences = self.generated(input_ids, attention_mask, new_tokens)
        finally:
            handle.remove()
        if sequences is None or sequences.shape[1] != input_ids.shape[1] + new_tokens or len(steps) < new_tokens:
            return None
        return sequences, torch.stack(steps[:new_tokens], dim=1)

    @property
    def greedy_declared(self) -> bool:
        """Whether ``generated`` asks for greedy decoding by name (transformers' ``do_sample=False``); else the
        model's ``generate`` runs with its own defaults."""
        return "generation_config" in _accepted_fn(self.model.generate)

    def generated(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, new_tokens: int = 8
                  ) -> torch.Tensor | None:
        """The sequences (B, T + new) the model's own ``generate`` returns for ``new_tokens`` tokens, as it
        returns them (None without a ``generate`` or a tensor of sequences). HF style (``generation_config``):
        greedy, one beam, exactly ``new_tokens``; else only ``max_new_tokens``."""
        if not self.has_generate:
            return None
        kwargs = {"max_new_tokens": new_tokens}
        if self.greedy_declared:  # transformers' GenerationMixin
            kwargs |= {"min_new_tokens": new_tokens, "do_sample": False, "num_beams": 1, "use_cache": True}
        if attention_mask is None and self.greedy_declared and self.takes_attention_mask:
            # an unpadded prompt's mask is all ones: said explicitly, transformers cannot mistake the prompt's tokens
            # for padding (it warns on a batched prompt without a mask when its pad id is its EOS id)
            attention_mask = torch.ones_like(input_ids)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        out = self.model.generate(input_ids, **kwargs)
        sequences = getattr(out, "sequences", out)
        return sequences if isinstance(sequences, torch.Tensor) and sequences.dim() == 2 else None


def _accepted_fn(fn) -> frozenset[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
