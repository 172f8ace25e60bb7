"""The device process gives its heap's free pages back when it goes idle (device/heap.py): once after steps ran and
no message came for IDLE_TRIM_S, not while messages keep coming, and not again until another step runs."""
from __future__ import annotations

from tandem.device.process import main


class FakeConn:
    """Answers poll() from a script of (has-message) booleans and hands out the messages in order."""

    def __init__(self, polls, messages):
        self.polls, self.messages = list(polls), list(messages)

    def poll(self, timeout):
        return self.polls.pop(0) if self.polls else bool(self.messages)

    def recv_bytes(self):
        return self.messages.pop(0)


def test_trims_once_per_idle_period(monkeypatch):
    trims, handled = [], []
    monkeypatch.setattr(main, "give_back_heap", lambda: trims.append(len(handled)))
    # step A, an idle poll (trim), step B, C already waiting (no trim), an idle poll (trim), then the quit
    conn = FakeConn([False, True, False], [b"A", b"B", b"C", b"Q"])
    loop = main._StepLoop(conn, None, None, None, None, None, None, None, None)
    monkeypatch.setattr(loop, "handle", lambda msg: handled.append(msg) or msg != b"Q")
    loop.run()
    assert handled == [b"A", b"B", b"C", b"Q"]
    assert trims == [1, 3]              # after A, after C; never before the first step nor twice in a row
