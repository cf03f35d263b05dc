"""Fault injection for the failure tests, so that they can drive real servers into the failures a
network or a device produces rarely. Installed as every connection's hook
(``transport/hooks.py``) by the transports of a process whose environment sets
``LAYERKV_TEST_FAULTS=1`` (``ENV``); even then it acts only on transfers whose transfer_id asks
for it (the tests mint such ids themselves), so one test cluster serves normal and faulty
requests.

* ``fault-write-...``: P's send channel fails every write of the transfer, as a broken link or a
  failed device copy would (``TransportError``).
* ``fault-late-...``: like ``fault-write-``, but only the writes after P told D the transfer is
  nearly done (``TransferNearlyDone``), and only after LATE_FAULT_DELAY_S (a link that stalls,
  then breaks): the last layer group fails after D had time to release the request early.
* ``fault-noack-...``: D never sends the transfer's acknowledgement (P must free the blocks
  after ``ack_timeout_s``).
* ``fault-slow-...``: every write of the transfer first waits SLOW_WRITE_DELAY_S, as on a slow
  link: the stream outlasts P's prefill by seconds (a 6-chunk prompt's 60 writes take 15 s), so
  a test that kills P or D "while KV streams" finds it still streaming when a loaded machine
  delivers the kill seconds late.
"""

from __future__ import annotations

import time

from vllm_layerkv.transport.base import TransportError
from vllm_layerkv.transport.hooks import TEST_HOOK_ENV, ConnectionHook, TransferMessage
from vllm_layerkv.wire.protocol import TransferAbort, TransferAck, TransferDone, TransferNearlyDone

ENV = TEST_HOOK_ENV
WRITE_FAULT_PREFIX = "fault-write-"
NO_ACK_PREFIX = "fault-noack-"
LATE_WRITE_FAULT_PREFIX = "fault-late-"
LATE_FAULT_DELAY_S = 0.5
SLOW_WRITE_PREFIX = "fault-slow-"
SLOW_WRITE_DELAY_S = 0.25


class FaultHook(ConnectionHook):
    """One connection end's faults: the transfers of this end that fail from now on."""

    def __init__(self) -> None:
        self._late: set[str] = set()
        """``fault-late-`` transfers this end announced as nearly done and has not ended."""

    def before_write(self, transfer_id: str) -> None:
        if transfer_id.startswith(SLOW_WRITE_PREFIX):
            time.sleep(SLOW_WRITE_DELAY_S)
        if transfer_id in self._late:
            time.sleep(LATE_FAULT_DELAY_S)
        if transfer_id.startswith(WRITE_FAULT_PREFIX) or transfer_id in self._late:
            raise TransportError(f"injected write fault for {transfer_id} ({ENV})")

    def sends(self, msg: TransferMessage) -> bool:
        if isinstance(msg, TransferNearlyDone):
            if msg.transfer_id.startswith(LATE_WRITE_FAULT_PREFIX):
                self._late.add(msg.transfer_id)
        elif isinstance(msg, (TransferDone, TransferAbort)):
            self._late.discard(msg.transfer_id)
        elif isinstance(msg, TransferAck):
            return not msg.transfer_id.startswith(NO_ACK_PREFIX)
        return True
