"""Our split-layout transfer modes as Miles external weight-transfer protocols.

In Miles::

    --update-weight-transfer-mode external \\
    --custom-weight-transfer-protocol-path rlplacement.integrations.miles.broadcast_packed

(or ``.broadcast``, ``.p2p``, ``.disk_delta``). Each name is a sync factory ``(args) ->
protocol``, as Miles' loader expects, with a ``validate_args(args)`` attribute that refuses what
our modes cannot serve before anything starts. Mode options come from Miles' args of the same
names as our flags (``--update-weight-disk-dir``, ``--check-weight-update-equal``,
``--p2p-protocol``, ``--p2p-transfer-timeout``, ``--update-weight-buffer-size``).

Written against the protocol of Miles' ``miles/backends/training_utils/weight_update/protocol.py``
(the version with ``--custom-weight-transfer-protocol-path``): ``connect`` once per engine set,
then per update ``begin_sync(version, iter_buckets)``, ``send_bucket`` per bucket on sender
ranks, ``after_base_weights``, ``finalize(version)``, ``after_engines_resumed``, ``pop_metrics``.

Receivers are rlplacement engines (``rlplacement.engines`` vLLM actors, or any actor with
``info``/``init_transfer``/``update_weights``/``received_checksums``): the trainer-side half is
ours, the engine-side half too. Miles' own SGLang servers do not run our receiver; ``connect``
refuses them naming the engine. Invariants: one sender (global rank 0, with pipeline stages
gathered), each engine stages the whole update and commits it at ``finalize`` or keeps its
previous version, and every wait is bounded and names who did not answer.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Sequence

from rlplacement.config import DEFAULT_BUCKET_BYTES
from rlplacement.errors import ConfigError
from rlplacement.integrations.options import transfer_config, transfer_option_keys
from rlplacement.transfer import registry
from rlplacement.transfer.base import DEFAULT_TIMEOUT_S, NamedTensor, TransferError, WeightUpdateError

try:  # Miles' base class and placement type where Miles is installed; the same shape otherwise
    from miles.backends.training_utils.weight_update.hf_weight_iterator import WeightUpdatePlacement
    from miles.backends.training_utils.weight_update.protocol import WeightTransferProtocol as _Base

    _SENDER_PLACEMENT = WeightUpdatePlacement(gather_pp=True)
except ImportError:  # pragma: no cover - exercised wherever Miles is absent (CI)
    _SENDER_PLACEMENT = None

    class _Base:  # the attributes Miles' updater reads
        def __init__(self, args):
            self.args = args
            self.rollout_engines = None
            self.is_sender = None
            self.update_weight_metrics: dict[str, float] = {}

        def pop_metrics(self) -> dict[str, float]:
            metrics, self.update_weight_metrics = self.update_weight_metrics, {}
            return metrics

def factories() -> dict[str, str]:
    """Factory name -> our transfer mode, for every registered mode whose spec names a Miles factory (read
    when asked, so a mode registered after this module's import has its factory too)."""
    return {s.miles_factory: name for name, s in registry.specs().items() if s.miles_factory}
_END = object()


def validate_args(args) -> None:
    """Refuse Miles flag combinations our protocols cannot serve, naming the flag."""
    path = getattr(args, "custom_weight_transfer_protocol_path", None) or ""
    _mode_config(factories().get(path.rpartition(".")[2], "broadcast"), args)


def _mode_config(mode: str, args):
    """``mode``'s validated TransferConfig from Miles' args, after refusing what no mode of ours serves."""
    if getattr(args, "colocate", False):
        raise ConfigError("--colocate: Miles moves colocated weights with its own CUDA IPC path and never calls an "
                          "external protocol; drop --custom-weight-transfer-protocol-path, or drop --colocate.")
    if getattr(args, "update_weight_transfer_mode", "external") != "external":
        raise ConfigError(f"--update-weight-transfer-mode {args.update_weight_transfer_mode}: Miles calls "
                          f"--custom-weight-transfer-protocol-path only with --update-weight-transfer-mode external.")
    if getattr(args, "lora_rank", 0):
        raise ConfigError("--lora-rank: rlplacement's protocols carry full weights, not LoRA adapters; "
                          "drop --lora-rank or use Miles' own transfer modes.")
    options = {k: getattr(args, k) for k in transfer_option_keys() if getattr(args, k, None) is not None}
    return transfer_config(mode, getattr(args, "update_weight_buffer_size", DEFAULT_BUCKET_BYTES), options,
                           where="Miles args")


class RlplacementProtocol(_Base):
    """One of our modes behind Miles' protocol; trainer global rank 0 sends, the rest only iterate."""

    required_placement = _SENDER_PLACEMENT
    supports_lora = False
    # no pause/flush/begin-update HTTP frame: our engines stage an update whole and swap it in
    # between requests, so generation never sees a mix of versions
    use_weight_update_session = False
    needs_base_resync_for_lora = False

    def __init__(self, args, mode: str):
        super().__init__(args)
        self.mode = mode
        self.config = _mode_config(mode, args)
        self.timeout_s = DEFAULT_TIMEOUT_S
        self._sender = None
        self._engines: list = []
        self._update: _StreamedUpdate | None = None

    def connect(self, rollout_engines: Sequence, engine_gpu_counts=None, engine_gpu_offsets=None,
                parallel_state=None, placement=None, selector: str = "all", *_, **__) -> None:
        """Called by every trainer rank, once per engine set: the sender (re)builds the group."""
        import torch.distributed as dist

        self.rollout_engines = list(rollout_engines)
        self.is_sender = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        if not self.is_sender:
            return
        from rlplacement.runtime.transfer_driver import engine_infos, group_size, join_refs, wait_all

        for i, engine in enumerate(self.rollout_engines):
            if not hasattr(engine, "init_transfer"):
                raise TransferError(f"rollout engine {i} ({engine!r}) does not run rlplacement's receiver: the "
                                    f"rlplacement protocols deliver into rlplacement engines (vLLM with our backend)")
        if self._sender is not None:
            self._sender.close()
        infos = engine_infos(self.rollout_engines, self.timeout_s)
        self._sender = registry.sender_class(self.mode)(
            self.config.bucket_bytes, check_equal=self.config.check_equal, timeout_s=self.timeout_s,
            **registry.sender_options(self.config, self.mode))
        refs = join_refs(self.rollout_engines, infos, self._sender.listen(group_size(infos)).to_dict())
        try:
            self._sender.connect()  # returns once every engine worker has joined
        except Exception as exc:  # name the engines that did not join, not only the sender's timeout
            try:
                wait_all(refs, 5.0)
            except WeightUpdateError as joined:
                raise WeightUpdateError(0, {**joined.failures, "trainer": f"{type(exc).__name__}: {exc}"}) from exc
            raise
        wait_all(refs, self.timeout_s)
        self._engines = self.rollout_engines

    def begin_sync(self, weight_version: int, iter_buckets: Callable | None = None) -> bool:
        if self.is_sender:
            refs = {f"engine {i}": e.update_weights.remote(int(weight_version)) for i, e in enumerate(self._engines)}
            self._update = _StreamedUpdate(self._sender, int(weight_version), refs, self.timeout_s)
        return True

    def send_bucket(self, bucket: list[NamedTensor], *_) -> None:
        self._update.put(bucket)

    def after_base_weights(self) -> None:
        if self.is_sender:
            self._update.end_of_stream()

    def finalize(self, weight_version: int) -> None:
        """Wait until every engine serves ``weight_version`` (or raise naming the ones that do not)."""
        if not self.is_sender:
            return
        update, self._update = self._update, None
        report, engines = update.result(self._engines, self.config.check_equal)
        self.update_weight_metrics = {
            "rlplacement/bytes": float(report.bytes), "rlplacement/seconds": float(report.seconds),
            "rlplacement/gbps": float(report.gbps), "rlplacement/num_buckets": float(report.num_buckets),
            "rlplacement/engine_load_s": max((e.load for e in engines), default=0.0)}

    def after_engines_resumed(self) -> None:
        pass


class _StreamedUpdate:
    """Feeds Miles' pushed buckets to our sender's pulled iterator: ``update`` runs in a thread,
    reading a queue of at most two buckets (bounded memory), while the engines receive. Both sides of the
    queue wait at most ``timeout_s`` and fail naming what did not come."""

    def __init__(self, sender, version: int, engine_refs: dict, timeout_s: float):
        self.version, self.engine_refs, self.timeout_s = version, engine_refs, timeout_s
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._report = self._error = None
        self._thread = threading.Thread(target=self._run, args=(sender,), name=f"rlplacement-update-{version}",
                                        daemon=True)
        self._thread.start()

    def _next(self):
        """The next bucket Miles pushed (or ``_END``), waiting at most ``timeout_s``: a trainer that stops
        pushing (it failed between ``send_bucket`` calls) fails the update by name instead of leaving the
        sender, and the engines receiving from it, waiting for good."""
        try:
            return self._queue.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TransferError(f"version {self.version}: Miles pushed no bucket for {self.timeout_s:g} s (neither "
                                f"send_bucket nor after_base_weights was called); the bound is "
                                f"RlplacementProtocol.timeout_s (transfer.base.DEFAULT_TIMEOUT_S)") from None

    def _tensors(self):
        while (bucket := self._next()) is not _END:
            yield from bucket

    def _run(self, sender) -> None:
        try:
            self._report = sender.update(self.version, self._tensors())
        except BaseException as exc:  # re-raised on the caller's thread
            self._error = exc
            try:
                while self._next() is not _END:  # let the producer finish its stream
                    pass
            except TransferError:  # the producer stopped too: nothing is left to drain
                pass

    def put(self, item) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                if not self._thread.is_alive() or time.monotonic() > deadline:
                    raise TransferError(f"version {self.version}: the sender took no bucket for {self.timeout_s:g} s "
                                        f"({self._error or 'no error yet'})") from self._error

    def end_of_stream(self) -> None:
        self.put(_END)
        self._thread.join(self.timeout_s)

    def result(self, engines, check_equal: bool):
        from rlplacement.runtime.transfer_driver import check_received, wait_all

        failures = {}
        try:
            results = wait_all(self.engine_refs, self.timeout_s, self.version)
        except WeightUpdateError as exc:
            failures.update(exc.failures)
        if self._thread.is_alive():
            failures["trainer"] = f"sender still running after {self.timeout_s:g} s"
        elif self._error is not None:
            failures["trainer"] = f"{type(self._error).__name__}: {self._error}"
        if failures:
            raise WeightUpdateError(self.version, failures)
        if check_equal:
            check_received(engines, self._report.checksums, self.version, self.timeout_s)
        return self._report, [results[f"engine {i}"] for i in range(len(engines))]


def _factory(factory_name: str, mode: str) -> Callable[[Any], RlplacementProtocol]:
    def build(args) -> RlplacementProtocol:
        return RlplacementProtocol(args, mode)

    build.__name__ = build.__qualname__ = factory_name
    build.__doc__ = f"Miles protocol factory for our mode {mode!r}."
    build.validate_args = validate_args
    return build


def __getattr__(name: str):
    """``rlplacement.integrations.miles.<factory>`` for every mode whose spec names a Miles factory
    (``--custom-weight-transfer-protocol-path`` points here)."""
    modes = factories()
    if name in modes:
        return _factory(name, modes[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
