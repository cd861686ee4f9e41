--[[ purge.lua -- drop up to `limit` waiting (queued) tasks of the queue.
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] limit   ARGV[4] retention s
Each purged task ends 'cancelled' with the error 'purged' (its waiting client is
told, as for a cancel), and its stream list is emptied. Running tasks, retries
waiting for their delay and dead letters are left alone (see dlq.lua). Cost:
O(purged + streams visited); the caller loops until nothing is left, so Redis is
never blocked for long.
Returns: {purged, more} where more = 1 if waiting tasks may remain.
]]
--@include _lib.lua
local limit, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local purged, streams_emptied = 0, 0
local ids = {}

local function drop(id)
  local f = redis.call('HMGET', K_TASK .. id, 'status', 'trace', 'band', 'tenant', 'cost')
  if f[1] == 'queued' then
    if sched_on() then sch().lane_count(f[3], f[4], -1, -tonumber(f[5] or '1'), 0) end
    finish(id, 'cancelled', now, ttl, 'error', 'purged')
    purged = purged + 1
    ids[#ids + 1] = id
  else  -- a tombstone (cancelled / expired while waiting): its retention starts now
    redis.call('EXPIRE', K_TASK .. id, ttl)
    if f[2] ~= '0' then redis.call('EXPIRE', K_TRACE .. id, ttl) end
  end
end

-- the lanes: ('s', '') (K_READY, K_FREE), and with scheduling on every other lane that
-- had work (see _lib.lua)
local lanes = {{'s', ''}}
if sched_on() then
  for _, l in ipairs(redis.call('SMEMBERS', K_SCHED .. 'lanes')) do
    local b, t = string.sub(l, 1, 1), string.sub(l, 3)
    if b ~= 's' or t ~= '' then lanes[#lanes + 1] = {b, t} end
  end
end
-- the lane's lists (the lane ('s', '') keeps K_READY and K_FREE)
local function ring_of(b, t) return (b == 's' and t == '') and K_READY or sch().lane_ring(b, t) end
local function free_of(b, t) return (b == 's' and t == '') and K_FREE or sch().lane_free(b, t) end
-- stream-less tasks
for _, l in ipairs(lanes) do
  local fl = free_of(l[1], l[2])
  while purged < limit do
    local id = redis.call('LPOP', fl)
    if not id then break end
    drop(id)
  end
end
-- streams: those in the rings (claimable) and those busy (a task running, more waiting)
local function empty_stream(s)
  local sk = K_STREAM .. s
  while purged < limit do
    local id = redis.call('LPOP', sk)
    if not id then break end
    drop(id)
  end
  if redis.call('LLEN', sk) == 0 then
    streams_emptied = streams_emptied + 1
    return true
  end
  return false
end
local visited = {}
for _, l in ipairs(lanes) do
  local ring = ring_of(l[1], l[2])
  for _, s in ipairs(redis.call('LRANGE', ring, 0, -1)) do
    if purged >= limit then break end
    if s ~= FREE and not visited[s] then
      visited[s] = true
      if redis.call('EXISTS', K_STREAM .. s) == 1 and empty_stream(s) then
        redis.call('LREM', ring, 0, s)
      end
    end
  end
end
for _, s in ipairs(redis.call('SMEMBERS', K_BUSY)) do
  if purged >= limit then break end
  if not visited[s] and redis.call('EXISTS', K_STREAM .. s) == 1 then
    visited[s] = true
    empty_stream(s)
  end
end
for _, l in ipairs(lanes) do
  if redis.call('LLEN', free_of(l[1], l[2])) == 0 then
    redis.call('LREM', ring_of(l[1], l[2]), 0, FREE)
    if l[1] == 's' and l[2] == '' then
      redis.call('HSET', K_STATS, 'free_marked', '0')
    else
      redis.call('HDEL', K_SCHED .. 'marked', l[1] .. ':' .. l[2])
    end
  end
end
if purged > 0 then
  redis.call('HINCRBY', K_STATS, 'waiting', -purged)
  redis.call('HINCRBY', K_STATS, 'cancelled', purged)
  event('purged', now, {ids = ids})
end
if streams_emptied > 0 then redis.call('HINCRBY', K_STATS, 'streams', -streams_emptied) end
flush_replies()
return {purged, purged >= limit and 1 or 0}
