"""The Lua scripts of `reach.store.redis`: each registry step is one of them, so it is atomic
in Redis (a Cluster runs each on one slot: the keys they name share a hash tag)."""

HELPERS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function group_of(flat)
  for i = 1, #flat, 2 do
    if flat[i] == '_group' then return flat[i + 1] end
  end
  return nil
end
"""

# KEYS: record, new group's index, groups. ARGV: group-key prefix, id, group, ttl ms,
# group ttl ms, field/value pairs...
PUT = (
    HELPERS
    + """
local previous = redis.call('HGETALL', KEYS[1])
local old = group_of(previous)
if old and old ~= ARGV[3] then redis.call('SREM', ARGV[1] .. old, ARGV[2]) end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], '_group', ARGV[3], unpack(ARGV, 6))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], now_ms() + tonumber(ARGV[5]), ARGV[3])
return previous
"""
)

# KEYS: record, groups. ARGV: group-key prefix, id, ttl ms, group ttl ms, field/value pairs...
UPDATE = (
    HELPERS
    + """
local previous = redis.call('HGETALL', KEYS[1])
if #previous == 0 then return previous end
if #ARGV >= 5 then redis.call('HSET', KEYS[1], unpack(ARGV, 5)) end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local group = group_of(previous)
if group then
  redis.call('SADD', ARGV[1] .. group, ARGV[2])
  redis.call('ZADD', KEYS[2], now_ms() + tonumber(ARGV[4]), group)
end
return previous
"""
)

# KEYS: record. ARGV: group-key prefix, id.
DELETE = (
    HELPERS
    + """
local previous = redis.call('HGETALL', KEYS[1])
if #previous == 0 then return previous end
redis.call('DEL', KEYS[1])
local group = group_of(previous)
if group then redis.call('SREM', ARGV[1] .. group, ARGV[2]) end
return previous
"""
)

# One page of a group (SSCAN: a member there throughout is seen, maybe twice; each page holds
# Redis, and the client parsing its answer, for ~SCAN_COUNT records, not for the whole group).
# KEYS: the group's index. ARGV: record-key prefix, group, cursor, count.
# Returns {next cursor, {id, fields, ...}, evicted}.
SCAN = (
    HELPERS
    + """
local live, evicted = {}, {}
local page = redis.call('SSCAN', KEYS[1], ARGV[3], 'COUNT', ARGV[4])
for _, id in ipairs(page[2]) do
  local flat = redis.call('HGETALL', ARGV[1] .. id)
  if #flat > 0 and group_of(flat) == ARGV[2] then
    table.insert(live, id)
    table.insert(live, flat)
  elseif redis.call('SREM', KEYS[1], id) == 1 and #flat == 0 then
    table.insert(evicted, id)
  end
end
return {page[1], live, evicted}
"""
)

# A page of a group, as _SCAN. KEYS: the group's index. ARGV: record-key prefix, group, cursor,
# count. Returns {next cursor, the ids pruned, the shortest TTL in ms of the page's live members
# (-1: none)}: no member of the page can expire sooner.
PRUNE = (
    HELPERS
    + """
local evicted, soonest = {}, -1
local page = redis.call('SSCAN', KEYS[1], ARGV[3], 'COUNT', ARGV[4])
for _, id in ipairs(page[2]) do
  local group = redis.call('HGET', ARGV[1] .. id, '_group')
  if not group then
    if redis.call('SREM', KEYS[1], id) == 1 then table.insert(evicted, id) end
  elseif group ~= ARGV[2] then
    redis.call('SREM', KEYS[1], id)
  else
    local ttl = redis.call('PTTL', ARGV[1] .. id)
    if ttl >= 0 and (soonest < 0 or ttl < soonest) then soonest = ttl end
  end
end
return {page[1], evicted, soonest}
"""
)

# KEYS: groups. ARGV: group.
KNOWN = (
    HELPERS
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) > now_ms() then return 1 end
return 0
"""
)

# KEYS: groups.
GROUPS = HELPERS + "return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_ms(), '+inf')"

# KEYS: groups. ARGV: group-key prefix.
EXPIRE = (
    HELPERS
    + """
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms())
for _, group in ipairs(gone) do
  redis.call('DEL', ARGV[1] .. group)
  redis.call('ZREM', KEYS[1], group)
end
return gone
"""
)

# KEYS: counter. ARGV: ttl ms (0: none).
INCR = """
local n = redis.call('INCR', KEYS[1])
if tonumber(ARGV[1]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return n
"""

# KEYS: hash. ARGV: field. The value it held (nil: none), removed.
HASH_DELETE = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v then redis.call('HDEL', KEYS[1], ARGV[1]) end
return v
"""
