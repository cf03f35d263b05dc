"""Test-only fault injection, so the failure tests can drive real servers into the failures a
network or a device produces rarely. Off unless the environment of the vLLM processes sets
``LAYERKV_TEST_FAULTS=1``; even then it acts only on transfers whose transfer_id asks for it
(the tests mint such ids themselves), so one test cluster serves normal and faulty requests.

* ``fault-write-...``: P's send channel fails every write of the transfer, as a broken link or a
  failed device copy would (``TransportError``).
* ``fault-late-...``: like ``fault-write-``, but only the writes after P told D the transfer is
  nearly done (``TransferNearlyDone``), and only after LATE_FAULT_DELAY_S (a link that stalls,
  then breaks): the last layer group fails after D had time to release the request early.
* ``fault-noack-...``: D never sends the transfer's acknowledgement (P must free the blocks
  after ``ack_timeout_s``).
"""

from __future__ import annotations

import os

ENV = "LAYERKV_TEST_FAULTS"
ENABLED = os.environ.get(ENV) == "1"
WRITE_FAULT_PREFIX = "fault-write-"
NO_ACK_PREFIX = "fault-noack-"
LATE_WRITE_FAULT_PREFIX = "fault-late-"
LATE_FAULT_DELAY_S = 0.5


def write_fails(transfer_id: str) -> bool:
    return ENABLED and transfer_id.startswith(WRITE_FAULT_PREFIX)


def late_write_fails(transfer_id: str) -> bool:
    return ENABLED and transfer_id.startswith(LATE_WRITE_FAULT_PREFIX)


def ack_dropped(transfer_id: str) -> bool:
    return ENABLED and transfer_id.startswith(NO_ACK_PREFIX)
