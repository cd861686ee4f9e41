--[[ ack.lua -- record the results of a batch, fenced by lease token.
KEYS: the standard nineteen (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] retention s   ARGV[4] n, then n groups of 3: id, lease token, result (msgpack)
ARGV[5 + 3n] result cache TTL s (0 = off)   ARGV[6 + 3n] most cache entries
ARGV[7 + 3n] the model version the acking worker serves ('' = not known here, as in a
  generator's outlet process: only the queue's model record is checked)
Returns: one code per task: 1 = recorded; E_LEASE_LOST = the task is not running
  under this token any more (its lease expired and it was reclaimed, or it was
  already finished): nothing is changed, the result of the current owner stands.
Result cache (see submit.lua): a task that recorded a cache entry suffix
('cache' = version .. ':' .. digest) at submit writes its result there if the
version is still the queue's model version (K_MODEL) and the acking worker's (a fleet
half way through a reload must not file an old model's result under the new key), the
result is at most REPLY_INLINE bytes (a hit answers inline, in one round trip) and
no entry exists yet. The index (K_CACHEX) member is size .. '|' .. suffix, scored
by expiry; expired members are swept and the oldest evicted past the most
entries, keeping the stats' cache_bytes equal to the sum of the members' sizes.
]]
--@include _lib.lua
local ttl, n = tonumber(ARGV[3]), tonumber(ARGV[4])
local cache_ttl, cache_max, version = tonumber(ARGV[5 + 3 * n]), tonumber(ARGV[6 + 3 * n]),
  ARGV[7 + 3 * n]
local now = now_ms()
local codes, done, woken = {}, {}, 0
local model_version = nil

-- Drop index members (their entries too) and their bytes.
local function cache_drop(members)
  local freed = 0
  for _, m in ipairs(members) do
    local size, suffix = string.match(m, '^(%d+)|(.*)$')
    if suffix then
      redis.call('DEL', K_CACHE .. suffix)
      freed = freed + tonumber(size)
    end
  end
  return freed
end

local function cache_put(suffix, result)
  if cache_ttl <= 0 or #result > REPLY_INLINE then return end
  if not model_version then model_version = redis.call('HGET', K_MODEL, 'version') or '' end
  local prefix = model_version .. ':'
  if model_version == '' or (version ~= '' and version ~= model_version) or
      string.sub(suffix, 1, #prefix) ~= prefix then return end
  local ek = K_CACHE .. suffix
  if redis.call('EXISTS', ek) == 1 then return end
  local delta = 0
  local expired = redis.call('ZRANGEBYSCORE', K_CACHEX, '-inf', now, 'LIMIT', 0, 64)
  if #expired > 0 then
    redis.call('ZREM', K_CACHEX, unpack(expired))
    delta = delta - cache_drop(expired)
  end
  redis.call('SET', ek, redis.sha1hex(result) .. result, 'EX', cache_ttl)
  -- 0: the same member was still indexed (its entry expired unswept): counted already
  if redis.call('ZADD', K_CACHEX, now + cache_ttl * 1000, #result .. '|' .. suffix) == 1 then
    delta = delta + #result
  end
  local over = redis.call('ZCARD', K_CACHEX) - cache_max
  if over > 0 then
    local popped = redis.call('ZPOPMIN', K_CACHEX, over)
    local members = {}
    for j = 1, #popped, 2 do members[#members + 1] = popped[j] end
    delta = delta - cache_drop(members)
  end
  redis.call('HINCRBY', K_STATS, 'cache_bytes', delta)
end

for i = 0, n - 1 do
  local b = 5 + i * 3
  local id, token = ARGV[b], ARGV[b + 1]
  local f = redis.call('HMGET', K_TASK .. id, 'status', 'token', 'stream', 'cache')
  if f[1] ~= 'running' or f[2] ~= token then
    codes[i + 1] = E_LEASE_LOST
  else
    redis.call('ZREM', K_LEASES, id)
    if f[4] then cache_put(f[4], ARGV[b + 2]) end
    finish(id, 'succeeded', now, ttl, 'result', ARGV[b + 2])
    if f[3] then woken = woken + release_stream(f[3]) end
    codes[i + 1] = 1
    done[#done + 1] = id
  end
end
if #done > 0 then
  redis.call('HINCRBY', K_STATS, 'succeeded', #done)
  event('succeeded', now, {ids = done})
end
if woken > 0 then nudge() end
flush_replies()
return codes
