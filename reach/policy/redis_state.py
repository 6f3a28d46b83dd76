"""The Redis policy state: each method is one Lua script, atomic for every gateway and worker
(`record` two, the second only when a failure would open the breaker: `reach.policy.breaker`).

Key layout under `<prefix>:pol:` (every key has a TTL, so nothing outlives its use):

- `brk:<capability>` a hash, absent while closed and clean: `until` (ms; present = open, or
  half-open once passed), `fail` (consecutive failures), `win` (the last `window` outcomes,
  oldest first, "1" a failure), `who` (who failed, space-separated: the run's instances, or
  one per failure in the window, `-` for one of an instance routing no longer serves from),
  `slots` (half-open probe leases' ends, ms, space-separated), `ok` (probes that succeeded).
  TTL `open_duration_ms` + 6 h from the last write.
- `out:<capability>` a hash, instance id -> "run ejections ejected_until forget_at" (ms); an
  entry past `forget_at` is dropped when met. TTL `max_ejection_ms` + 5 min.
- `tb:<key>` a hash: `tok`, `ts` (ms), `rate` (tokens a ms), `cap`; it expires when it would be
  full again, and a missing bucket is a full one.
- `claim:<key>` a string with the claim's TTL.

On a Redis Cluster `<prefix>` is the store's hash tag (`{<prefix>}`), so `_RECORD`'s two
keys and `_TAKE`'s buckets share one slot. Times are Redis `TIME` in ms. The rules are
`MemoryPolicyState`'s, step for step. Like `RedisStore`, a script may run twice after a dropped
connection; a repeated `record` counts an outcome twice and a repeated `take` takes two tokens,
both harmless at that rate.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, cast

from redis.commands.core import AsyncScript

from reach.config import CircuitBreakerSettings, OutlierSettings
from reach.policy.breaker import departed
from reach.policy.state import (
    Admission,
    BreakerStatus,
    BreakerView,
    Bucket,
    CapabilityView,
    PolicyState,
    breaker_ttl_ms,
    outlier_forget_ms,
)
from reach.store.redis import ttl_ms, unavailable_on_error
from reach.store.redis_connect import RedisClient

_HELPERS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function breaker_view(key, now, enabled, window)
  if enabled == 0 then return {'closed', 0, 0} end
  local v = redis.call('HMGET', key, 'until', 'fail', 'win')
  local opened_until = tonumber(v[1])
  if opened_until then
    if now < opened_until then return {'open', 0, opened_until - now} end
    return {'half_open', 0, 0}
  end
  if window == 0 then return {'closed', tonumber(v[2]) or 0, 0} end
  local _, failures = string.gsub(string.sub(v[3] or '', -window), '1', '')
  return {'closed', failures, 0}
end
local function parse(entry)
  local run, ej, ejected_until, forget_at = string.match(entry, '^(%d+) (%d+) (%d+) (%d+)$')
  return tonumber(run), tonumber(ej), tonumber(ejected_until), tonumber(forget_at)
end
local function outlier_view(key, now)
  local flat = redis.call('HGETALL', key)
  local ejected, failing = {}, {}
  for i = 1, #flat, 2 do
    local run, _, ejected_until, forget_at = parse(flat[i + 1])
    if forget_at <= now then
      redis.call('HDEL', key, flat[i])
    else
      if ejected_until > now then
        table.insert(ejected, flat[i])
        table.insert(ejected, ejected_until - now)
      end
      if run > 0 then table.insert(failing, flat[i]) end
    end
  end
  return {ejected, failing}
end
local function distinct(ids)
  local seen, n = {}, 0
  for _, id in ipairs(ids) do
    if id ~= '-' and not seen[id] then seen[id], n = true, n + 1 end
  end
  return n
end
local function split(s)
  local ids = {}
  for id in string.gmatch(s or '', '%S+') do table.insert(ids, id) end
  return ids
end
local function live_slots(slots, now)
  local live = {}
  for s in string.gmatch(slots or '', '%d+') do
    local t = tonumber(s)
    if t > now then table.insert(live, t) end
  end
  table.sort(live)
  return live
end
"""

# KEYS: breaker, outliers. ARGV: breaker enabled (0/1), window.
# Returns {status, failures, retry ms, {id, ms left, ...}, {failing id, ...}}.
_VIEW = (
    _HELPERS
    + """
local now = now_ms()
local b = breaker_view(KEYS[1], now, tonumber(ARGV[1]), tonumber(ARGV[2]))
local o = outlier_view(KEYS[2], now)
return {b[1], b[2], b[3], o[1], o[2]}
"""
)

# KEYS: breaker. ARGV: open ms, half-open probes, breaker TTL ms.
# Returns {status, allowed, probe, retry ms}.
_ADMIT = (
    _HELPERS
    + """
local now = now_ms()
local v = redis.call('HMGET', KEYS[1], 'until', 'slots')
local opened_until = tonumber(v[1])
if not opened_until then return {'closed', 1, 0, 0} end
if now < opened_until then return {'open', 0, 0, opened_until - now} end
local live = live_slots(v[2], now)
if #live < tonumber(ARGV[2]) then
  table.insert(live, now + tonumber(ARGV[1]))
  redis.call('HSET', KEYS[1], 'slots', table.concat(live, ' '))
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'half_open', 1, 1, 0}
end
return {'half_open', 0, 0, math.max(1, live[1] - now)}
"""
)

# KEYS: breaker, outliers. ARGV: 1 breaker enabled, 2 error threshold, 3 window, 4 open ms,
# 5 half-open probes, 6 breaker TTL ms, 7 instance, 8 ok, 9 probe, 10 outlier enabled,
# 11 consecutive failures, 12 base ejection ms, 13 max ejection ms, 14 forget ms,
# 15 quorum (distinct failing instances that open it; 0: the breaker ignores this outcome),
# 16 serving given (1: the caller knows who routing serves from, so a count that would open it
# is not decided here: reach.policy.breaker's step 3).
# Returns what _VIEW does, afterwards, and `who` ({} unless step 3 is due: then _SETTLE).
_RECORD = (
    _HELPERS
    + """
local now = now_ms()
local ok, probe = ARGV[8] == '1', ARGV[9] == '1'
local threshold, window = tonumber(ARGV[2]), tonumber(ARGV[3])
local quorum, instance = tonumber(ARGV[15]), ARGV[7]
local settle = ARGV[16] == '1'
local brk, out = KEYS[1], KEYS[2]
local check = {}
local function open()
  redis.call('DEL', brk)
  redis.call('HSET', brk, 'until', now + tonumber(ARGV[4]))
  redis.call('PEXPIRE', brk, ARGV[6])
end
local function save(...)
  redis.call('HSET', brk, ...)
  redis.call('PEXPIRE', brk, ARGV[6])
end
if ARGV[1] == '1' and quorum ~= 0 then
  local v = redis.call('HMGET', brk, 'until', 'fail', 'win', 'slots', 'ok', 'who')
  local who = split(v[6])
  local opened_until = tonumber(v[1])
  if opened_until then
    if now >= opened_until then
      if not ok then
        open()
      elseif probe then
        local successes = (tonumber(v[5]) or 0) + 1
        if successes >= tonumber(ARGV[5]) then
          redis.call('DEL', brk)
        else
          local live = live_slots(v[4], now)
          table.remove(live, 1)
          save('ok', successes, 'slots', table.concat(live, ' '))
        end
      end
    end
  elseif window == 0 then
    local fail = tonumber(v[2]) or 0
    if ok then
      if fail > 0 then save('fail', 0, 'who', '') end
    else
      local known = false
      for _, id in ipairs(who) do
        if id == instance then known = true end
      end
      if not known then table.insert(who, instance) end
      if fail + 1 >= threshold and distinct(who) >= quorum and not settle then
        open()
      else
        save('fail', fail + 1, 'who', table.concat(who, ' '))
        if fail + 1 >= threshold and distinct(who) >= quorum then check = who end
      end
    end
  else
    local win = string.sub((v[3] or '') .. (ok and '0' or '1'), -window)
    local _, failures = string.gsub(win, '1', '')
    if not ok then table.insert(who, instance) end
    local kept = {}
    for i = math.max(1, #who - failures + 1), #who do table.insert(kept, who[i]) end
    if failures >= threshold and distinct(kept) >= quorum and not settle then
      open()
    else
      save('win', win, 'who', table.concat(kept, ' '))
      if failures >= threshold and distinct(kept) >= quorum then check = kept end
    end
  end
end
if ARGV[10] == '1' then
  local entry = redis.call('HGET', out, instance)
  local run, ej, ejected_until, forget_at = 0, 0, 0, 0
  if entry then
    run, ej, ejected_until, forget_at = parse(entry)
    if forget_at <= now then run, ej, ejected_until, forget_at = 0, 0, 0, 0 end
  end
  if ok then
    if ej > 0 or ejected_until > now then
      redis.call('HSET', out, instance, '0 ' .. ej .. ' ' .. ejected_until .. ' ' .. forget_at)
    elseif entry then
      redis.call('HDEL', out, instance)
    end
  else
    run = run + 1
    if run >= tonumber(ARGV[11]) then
      local ms = math.min(tonumber(ARGV[13]), tonumber(ARGV[12]) * 2 ^ math.min(ej, 62))
      ejected_until, ej, run = now + ms, ej + 1, 0
    end
    local forget = now + tonumber(ARGV[14])
    redis.call('HSET', out, instance, run .. ' ' .. ej .. ' ' .. ejected_until .. ' ' .. forget)
    redis.call('PEXPIRE', out, ARGV[14])
  end
end
local b = breaker_view(brk, now, tonumber(ARGV[1]), window)
local o = outlier_view(out, now)
return {b[1], b[2], b[3], o[1], o[2], check}
"""
)

# reach.policy.breaker's step 3, after _RECORD returned `who`: the ids given, of instances
# routing no longer serves from, leave `who` (in a window each becomes '-'), and the breaker
# opens if the count still makes it. Nothing, if it is no longer closed.
# KEYS: breaker, outliers. ARGV: 1 error threshold, 2 window, 3 open ms, 4 breaker TTL ms,
# 5 quorum, 6... the departed ids. Returns what _VIEW does, afterwards.
_SETTLE = (
    _HELPERS
    + """
local now = now_ms()
local threshold, window, quorum = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[5])
local brk = KEYS[1]
local gone = {}
for i = 6, #ARGV do gone[ARGV[i]] = true end
local v = redis.call('HMGET', brk, 'until', 'fail', 'win', 'who')
if not v[1] and (v[2] or v[3]) then
  local failures, kept = tonumber(v[2]) or 0, {}
  if window > 0 then
    local _, n = string.gsub(string.sub(v[3] or '', -window), '1', '')
    failures = n
  end
  for _, id in ipairs(split(v[4])) do
    if not gone[id] then
      table.insert(kept, id)
    elseif window > 0 then
      table.insert(kept, '-')
    end
  end
  if failures >= threshold and distinct(kept) >= quorum then
    redis.call('DEL', brk)
    redis.call('HSET', brk, 'until', now + tonumber(ARGV[3]))
  else
    redis.call('HSET', brk, 'who', table.concat(kept, ' '))
  end
  redis.call('PEXPIRE', brk, ARGV[4])
end
local b = breaker_view(brk, now, 1, window)
local o = outlier_view(KEYS[2], now)
return {b[1], b[2], b[3], o[1], o[2]}
"""
)

# KEYS: buckets. ARGV: per bucket, tokens a ms and capacity.
# Returns ms to wait as a string ('0': taken).
_TAKE = (
    _HELPERS
    + """
local now = now_ms()
local tokens, wait = {}, 0
for i, key in ipairs(KEYS) do
  local rate, cap = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local v = redis.call('HMGET', key, 'tok', 'ts')
  local t = cap
  if v[1] then t = math.min(cap, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * rate) end
  tokens[i] = t
  if t < 1 then wait = math.max(wait, (1 - t) / rate) end
end
if wait > 0 then return string.format('%.17g', wait) end
for i, key in ipairs(KEYS) do
  local rate, cap = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local t = tokens[i] - 1
  redis.call('HSET', key, 'tok', string.format('%.17g', t), 'ts', now, 'rate', ARGV[2 * i - 1],
    'cap', cap)
  redis.call('PEXPIRE', key, math.ceil((cap - t) / rate) + 1000)
end
return '0'
"""
)

# KEYS: buckets. Returns the tokens now in each that exists: {index, tokens, ...}.
_BUCKETS = (
    _HELPERS
    + """
local now = now_ms()
local found = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('HMGET', key, 'tok', 'ts', 'rate', 'cap')
  if v[1] then
    local t = tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * tonumber(v[3])
    table.insert(found, i)
    table.insert(found, string.format('%.17g', math.min(tonumber(v[4]), t)))
  end
end
return found
"""
)

# KEYS: claim. ARGV: value, ttl ms.
_CLAIM = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return ARGV[1] end
return redis.call('GET', KEYS[1])
"""

# KEYS: claim. ARGV: value.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _view(reply: list[Any]) -> CapabilityView:
    status, failures, retry_ms, ejected, failing = reply[:5]
    return CapabilityView(
        breaker=BreakerView(cast(BreakerStatus, status), int(failures), int(retry_ms) / 1000),
        ejected={ejected[i]: int(ejected[i + 1]) / 1000 for i in range(0, len(ejected), 2)},
        failing=frozenset(failing),
    )


class RedisPolicyState(PolicyState):
    """On a client with `decode_responses=True` (a `RedisStore`'s); keys under `<prefix>:pol:`."""

    def __init__(self, client: RedisClient, prefix: str) -> None:
        self._r = client
        self._p = prefix
        # register_script: EVALSHA, reloading the script after NOSCRIPT (see RedisStore).
        self._view = client.register_script(_VIEW)
        self._admit = client.register_script(_ADMIT)
        self._record = client.register_script(_RECORD)
        self._settle = client.register_script(_SETTLE)
        self._take = client.register_script(_TAKE)
        self._buckets = client.register_script(_BUCKETS)
        self._claim = client.register_script(_CLAIM)
        self._release = client.register_script(_RELEASE)

    def _k(self, kind: str, name: str) -> str:
        return f"{self._p}:pol:{kind}:{name}"

    async def _run(self, script: AsyncScript, keys: list[str], args: list[Any]) -> Any:
        with unavailable_on_error(self._p):
            return await script(keys=keys, args=args)

    async def view(self, capability: str, breaker: CircuitBreakerSettings) -> CapabilityView:
        keys = [self._k("brk", capability), self._k("out", capability)]
        return _view(await self._run(self._view, keys, [int(breaker.enabled), breaker.window]))

    async def admit(self, capability: str, breaker: CircuitBreakerSettings) -> Admission:
        if not breaker.enabled:
            return Admission(True, "closed")
        args = [breaker.open_duration_ms, breaker.half_open_probes, breaker_ttl_ms(breaker)]
        status, allowed, probe, retry_ms = await self._run(
            self._admit, [self._k("brk", capability)], args
        )
        return Admission(bool(allowed), status, bool(probe), int(retry_ms) / 1000)

    async def record(
        self,
        capability: str,
        instance_id: str,
        ok: bool,
        breaker: CircuitBreakerSettings,
        outlier: OutlierSettings,
        probe: bool = False,
        quorum: int = 1,
        serving: Collection[str] = (),
    ) -> CapabilityView:
        keys = [self._k("brk", capability), self._k("out", capability)]
        args = [
            int(breaker.enabled),
            breaker.error_threshold,
            breaker.window,
            breaker.open_duration_ms,
            breaker.half_open_probes,
            breaker_ttl_ms(breaker),
            instance_id,
            int(ok),
            int(probe),
            int(outlier.enabled),
            outlier.consecutive_failures,
            outlier.base_ejection_ms,
            outlier.max_ejection_ms,
            outlier_forget_ms(outlier),
            quorum,
            int(bool(serving)),
        ]
        reply = await self._run(self._record, keys, args)
        who = reply[5]
        if who:  # the count would open it: step 3 (reach.policy.breaker), the rare case
            gone = departed(who, serving)
            args = [
                breaker.error_threshold,
                breaker.window,
                breaker.open_duration_ms,
                breaker_ttl_ms(breaker),
                quorum,
                *gone,
            ]
            reply = await self._run(self._settle, keys, args)
        return _view(reply)

    async def take(self, buckets: Sequence[Bucket]) -> float:
        if not buckets:
            return 0.0
        keys = [self._k("tb", b.key) for b in buckets]
        args = [part for b in buckets for part in (repr(b.per_minute / 60_000), b.capacity)]
        return float(await self._run(self._take, keys, args)) / 1000

    async def buckets(self, keys: Sequence[str]) -> dict[str, float]:
        if not keys:
            return {}
        found = await self._run(self._buckets, [self._k("tb", key) for key in keys], [])
        return {keys[int(found[i]) - 1]: float(found[i + 1]) for i in range(0, len(found), 2)}

    async def claim(self, key: str, value: str, ttl_s: float) -> str:
        return str(await self._run(self._claim, [self._k("claim", key)], [value, ttl_ms(ttl_s)]))

    async def peek(self, key: str) -> str | None:
        with unavailable_on_error(self._p):
            held = await self._r.get(self._k("claim", key))
        return None if held is None else str(held)

    async def put(self, key: str, value: str, ttl_s: float) -> None:
        with unavailable_on_error(self._p):
            await self._r.set(self._k("claim", key), value, px=ttl_ms(ttl_s))

    async def release(self, key: str, value: str) -> bool:
        return bool(await self._run(self._release, [self._k("claim", key)], [value]))
