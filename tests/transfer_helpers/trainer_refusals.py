"""What a trainer rank (``runtime.trainer_worker.TrainerWorker``, built around a backend in the test's own process)
answers to calls it should refuse: each refusal's message, or ``"accepted"`` where the call went through."""

from typing import Callable


def trainer_rank_answers(backend, rank: int, world: int, calls: list[Callable]) -> list[str]:
    """``call(worker)`` for each of ``calls`` on a trainer rank holding ``backend``: the ``RuntimeError`` each
    raised, as text, or ``"accepted"``."""
    from rlplacement.runtime.trainer_worker import TrainerWorker

    worker = TrainerWorker(rank, world)
    worker.backend = backend
    answers = []
    for call in calls:
        try:
            call(worker)
            answers.append("accepted")
        except RuntimeError as exc:
            answers.append(str(exc))
    return answers
