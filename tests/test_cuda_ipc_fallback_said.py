"""Mode ``cuda_ipc``'s bucket path taken for a resident update is said: one log line per sender naming the
reason, and ``perf/update_weights_fallback`` (1) in every such update's telemetry keys. On CPU a resident
update always goes by buckets (host memory cannot be mapped in place), so the real sender and receivers
over /dev/shm and gloo show both; a non-resident update, which has no direct path to miss, reports 0."""

import logging

import torch

from rlplacement.transfer.cuda_ipc.sender import HOST_MEMORY
from tests.test_transfer_broadcast import Session, _model


def _update(s: Session, version: int, named, resident: bool):
    (report, send_error), errors = s._threads(
        [lambda i=i: (s.receivers[i].begin(version), s.receivers[i].receive(),
                      s.receivers[i].commit(lambda staged, i=i: s.applied.__setitem__(i, staged)))
         for i in range(len(s.receivers))],
        lambda: (s.sender.update(version, named, resident=resident), None))
    assert errors == [None] * len(s.receivers) and send_error is None
    for applied in s.applied:
        assert all(torch.equal(a, t) for (_, a), (_, t) in zip(applied, named))
    return report


def test_a_resident_update_by_buckets_is_logged_once_and_reported_every_time(caplog):
    s = Session("cuda_ipc", check_equal=True)
    try:
        named = _model(1)
        with caplog.at_level(logging.WARNING, logger="rlplacement.transfer.cuda_ipc.sender"):
            reports = [_update(s, version, named, resident=True) for version in (1, 2)]
        said = [r.getMessage() for r in caplog.records if "cuda_ipc" in r.getMessage()]
        assert said == [f"rlplacement cuda_ipc: weight updates go by buckets, not the direct path: {HOST_MEMORY}"]
        for report in reports:
            assert report.path == "buckets" and report.fallback == HOST_MEMORY
            assert report.metrics["perf/update_weights_fallback"] == 1
        plain = _update(s, 3, named, resident=False)
        assert plain.fallback == "" and plain.metrics["perf/update_weights_fallback"] == 0
    finally:
        s.close()
