"""aiokvcache as an SGLang transfer backend (prefill/decode disaggregation).

Installed with ``pip install "aiokvcache[sglang]"``; SGLang loads
:func:`register` in every process through its plugin entry point
(``sglang.srt.plugins``), so a server takes
``--disaggregation-transfer-backend aiokvcache`` with no SGLang file edited.
The classes are in :mod:`.conn` (which imports SGLang), the data plane in
:mod:`.engine` (which does not). ``docs/sglang.md`` says what it
guarantees and what it does not support yet.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["BACKEND", "register"]

#: The name a server's ``--disaggregation-transfer-backend`` takes.
BACKEND = "aiokvcache"

log = logging.getLogger("aiokvcache.sglang")


def register() -> None:
    """Make ``aiokvcache`` a transfer backend SGLang accepts and builds.

    SGLang's ``TransferBackend`` enum is closed: the member is added to its
    tables, the command line's choices are extended, and an AROUND hook on
    ``get_kv_class`` returns this backend's classes for it (the hook
    registry patches the function wherever SGLang imported it).
    """
    try:
        from sglang.srt.arg_groups.choices import add_disagg_transfer_backend_choices
        from sglang.srt.disaggregation import utils
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError as exc:  # another SGLang version: say so, do not break its start
        log.warning("aiokvcache: cannot register the SGLang backend here: %s", exc)
        return
    add_disagg_transfer_backend_choices([BACKEND])
    enum = utils.TransferBackend
    if BACKEND not in enum._value2member_map_:
        member = object.__new__(enum)
        member._name_, member._value_ = "AIOKVCACHE", BACKEND
        type.__setattr__(enum, "AIOKVCACHE", member)
        enum._member_map_["AIOKVCACHE"] = member
        enum._value2member_map_[BACKEND] = member
        enum._member_names_.append("AIOKVCACHE")

    def get_kv_class(orig: Any, transfer_backend: Any, class_type: Any) -> Any:
        if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
            return orig(transfer_backend, class_type)
        if class_type == utils.KVClassType.KVARGS:
            from sglang.srt.disaggregation.base.conn import KVArgs

            return KVArgs
        from . import conn

        return {
            utils.KVClassType.MANAGER: conn.AioKVManager,
            utils.KVClassType.SENDER: conn.AioKVSender,
            utils.KVClassType.RECEIVER: conn.AioKVReceiver,
            utils.KVClassType.BOOTSTRAP_SERVER: conn.AioKVBootstrapServer,
        }[class_type]

    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", get_kv_class, HookType.AROUND
    )
