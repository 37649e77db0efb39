"""The dummy mode's two classes: broadcast's, named ``dummy``, with the dummy's option taken by name."""

from typing import ClassVar

from rlplacement.transfer.broadcast.receiver import BroadcastReceiver
from rlplacement.transfer.broadcast.sender import BroadcastSender
from tests.dummy_mode import DummyOptions


class DummySender(BroadcastSender):
    mode: ClassVar[str] = "dummy"

    def __init__(self, bucket_bytes: int, *, pigeons: int = 2, **kwargs):
        super().__init__(bucket_bytes, **kwargs)
        self.options = DummyOptions(pigeons)  # validates


class DummyReceiver(BroadcastReceiver):
    mode: ClassVar[str] = "dummy"
