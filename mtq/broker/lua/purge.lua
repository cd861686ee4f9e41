--[[ purge.lua -- drop up to `limit` waiting (queued) tasks of the queue.
KEYS: the standard twenty (see _lib.lua).
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
  local f = redis.call('HMGET', K_TASK .. id, 'status', 'trace')
  if f[1] == 'queued' then
    finish(id, 'cancelled', now, ttl, 'error', 'purged')
    purged = purged + 1
    ids[#ids + 1] = id
  else  -- a tombstone (cancelled / expired while waiting): its retention starts now
    redis.call('EXPIRE', K_TASK .. id, ttl)
    if f[2] ~= '0' then redis.call('EXPIRE', K_TRACE .. id, ttl) end
  end
end

-- stream-less tasks
while purged < limit do
  local id = redis.call('LPOP', K_FREE)
  if not id then break end
  drop(id)
end
-- streams: those in the ring (claimable) and those busy (a task running, more waiting)
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
for _, s in ipairs(redis.call('LRANGE', K_READY, 0, -1)) do
  if purged >= limit then break end
  if s ~= FREE and not visited[s] then
    visited[s] = true
    if redis.call('EXISTS', K_STREAM .. s) == 1 and empty_stream(s) then
      redis.call('LREM', K_READY, 0, s)
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
if redis.call('LLEN', K_FREE) == 0 then
  redis.call('LREM', K_READY, 0, FREE)
  redis.call('HSET', K_STATS, 'free_marked', '0')
end
if purged > 0 then
  redis.call('HINCRBY', K_STATS, 'waiting', -purged)
  redis.call('HINCRBY', K_STATS, 'cancelled', purged)
  event('purged', now, {ids = ids})
end
if streams_emptied > 0 then redis.call('HINCRBY', K_STATS, 'streams', -streams_emptied) end
flush_replies()
return {purged, purged >= limit and 1 or 0}
