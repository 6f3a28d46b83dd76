"""`reach gateway` gives up, loudly, once its Temporal is gone for good.

Under `reach up` the dev server is restarted for the gateway (`gateway_api.supervisor`), and the
gateway waits for it: its Temporal client reconnects by itself and `/readyz` is 503 meanwhile.
A gateway run on its own has nobody to bring Temporal back, and serving 503 for ever would hide
the outage from whatever runs the process. So once Temporal has not answered a health check for
`temporal.connect_wait_s` (the wait start-up allows it too), the gateway stops serving and exits
with code 1 and a message; systemd, Kubernetes or a person restarts it once Temporal is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import timedelta

from temporalio.client import Client
from temporalio.service import RPCError

log = logging.getLogger("reach.gateway")

CHECK_EVERY_S = 1.0
CHECK_TIMEOUT_S = 2.0


async def watch_temporal(
    client: Client,
    give_up_after_s: float,
    give_up: Callable[[str], None],
    *,
    every_s: float = CHECK_EVERY_S,
) -> None:
    """Call `give_up(message)` once Temporal has not answered for `give_up_after_s`, then end."""
    loop = asyncio.get_running_loop()
    target = client.service_client.config.target_host
    answered = loop.time()
    away = False
    while True:
        await asyncio.sleep(every_s)
        try:
            ok = await asyncio.wait_for(
                client.service_client.check_health(timeout=timedelta(seconds=CHECK_TIMEOUT_S)),
                CHECK_TIMEOUT_S + 1,
            )
        except (RPCError, RuntimeError, TimeoutError):
            ok = False
        if ok:
            if away:
                log.warning("Temporal at %s answers again", target)
            away, answered = False, loop.time()
            continue
        if not away:
            away = True
            log.warning(
                "Temporal at %s does not answer; the gateway exits if it has not answered for "
                "%g s (temporal.connect_wait_s)",
                target,
                give_up_after_s,
            )
        if loop.time() - answered >= give_up_after_s:
            message = (
                f"Temporal at {target} has not answered for {give_up_after_s:g} s "
                "(temporal.connect_wait_s): the gateway stops rather than answer 503 for ever. "
                "Start it again once Temporal is back (`reach up` restarts its own dev server)."
            )
            log.error("%s", message)
            give_up(message)
            return
