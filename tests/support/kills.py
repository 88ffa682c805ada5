"""Faults injected into worker processes: ``sitecustomize`` bodies a test writes into a
folder on the workers' PYTHONPATH, so the fault happens in the process it names."""

# A worker reaching the push phase named by $TANDEM_TEST_KILL_PHASE (of version 1) dies (the
# first to get there, marked by $TANDEM_TEST_KILL_MARK) by $TANDEM_TEST_KILL_SIGNAL.
KILL_IN_PHASE = """
    import os, signal
    from tandem.exchange import receiver

    honest = receiver.RankReceiver.handle

    def handle(self, phase, spec, records):
        if phase.value == os.environ["TANDEM_TEST_KILL_PHASE"] and spec.version == 1:
            try:  # the first worker to reach the phase dies (or stops), here, mid-push
                os.close(os.open(os.environ["TANDEM_TEST_KILL_MARK"], os.O_CREAT | os.O_EXCL))
                os.kill(os.getpid(), getattr(signal, os.environ["TANDEM_TEST_KILL_SIGNAL"]))
            except FileExistsError:
                pass
        return honest(self, phase, spec, records)

    receiver.RankReceiver.handle = handle
"""


# A heal (a peer's in-place push) in its verify phase: the healing worker, or the process
# $TANDEM_TEST_KILL_PID (the peer's worker), is killed once.
KILL_IN_HEAL = """
    import os, signal
    from tandem.exchange import receiver
    from tandem.exchange.settings import PushPhase

    honest = receiver.RankReceiver.handle

    def handle(self, phase, spec, records):
        if phase is PushPhase.VERIFY and spec.settings.in_place:  # a heal: a peer's push
            try:  # once: the healing worker itself, or the peer's worker, dies here
                os.close(os.open(os.environ["TANDEM_TEST_KILL_MARK"], os.O_CREAT | os.O_EXCL))
                pid = int(os.environ["TANDEM_TEST_KILL_PID"] or os.getpid())
                os.kill(pid, signal.SIGKILL)
            except FileExistsError:
                pass
        return honest(self, phase, spec, records)

    receiver.RankReceiver.handle = handle
"""
