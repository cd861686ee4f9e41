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
result is at most REPLY_INLINE bytes (a hit answers inline, in one round trip): one
SET per task, over the task's single-flight marker (or an identical task's earlier
result, if its marker expired). The index (K_CACHEX) member is size .. '|' .. suffix,
scored by expiry; once per call, expired members are swept, the new ones added and
the soonest to expire evicted past the most entries, keeping the stats' cache_bytes
equal to the sum of the members' sizes.
]]
--@include _lib.lua
local ttl, n = tonumber(ARGV[3]), tonumber(ARGV[4])
local cache_ttl, cache_max, version = tonumber(ARGV[5 + 3 * n]), tonumber(ARGV[6 + 3 * n]),
  ARGV[7 + 3 * n]
local now = now_ms()
local codes, done, woken = {}, {}, 0
local model_version = nil

-- Drop index members (their entries too) and their bytes: one DEL per 1000 keys.
local function cache_drop(members)
  local freed, keys = 0, {}
  for _, m in ipairs(members) do
    local size, suffix = string.match(m, '^(%d+)|(.*)$')
    if suffix then
      keys[#keys + 1] = K_CACHE .. suffix
      freed = freed + tonumber(size)
      if #keys == 1000 then redis.call('DEL', unpack(keys)); keys = {} end
    end
  end
  if #keys > 0 then redis.call('DEL', unpack(keys)) end
  return freed
end

-- The entries this call files: index members and their expiry (one ZADD at the end),
-- and the change of cache_bytes.
local filed, filed_sizes, cache_delta, swept = {}, {}, 0, false

-- File a result over its task's single-flight marker: one SET per task; the index,
-- the sweep of expired entries and the bytes are done once per call (cache_index).
local function cache_put(id, suffix, result)
  if cache_ttl <= 0 or #result > REPLY_INLINE then return end
  if not model_version then model_version = redis.call('HGET', K_MODEL, 'version') or '' end
  local prefix = model_version .. ':'
  if model_version == '' or (version ~= '' and version ~= model_version) or
      string.sub(suffix, 1, #prefix) ~= prefix then return end
  if not swept then  -- before any SET of this call: the sweep deletes entry keys
    swept = true
    local expired = redis.call('ZRANGEBYSCORE', K_CACHEX, '-inf', now, 'LIMIT', 0, 2 * n + 16)
    if #expired > 0 then
      redis.call('ZREM', K_CACHEX, unpack(expired))
      cache_delta = cache_delta - cache_drop(expired)
    end
  end
  local old = redis.call('SET', K_CACHE .. suffix, redis.sha1hex(result) .. result,
    'EX', cache_ttl, 'GET')
  CACHE_FILED[id] = true
  if old and string.sub(old, 1, 4) ~= 'run:' and #old >= 40 then
    -- an identical task's result was there (its marker had expired): this one replaces it
    if redis.call('ZREM', K_CACHEX, (#old - 40) .. '|' .. suffix) == 1 then
      cache_delta = cache_delta - (#old - 40)
    end
  end
  local k = #filed
  filed[k + 1] = now + cache_ttl * 1000
  filed[k + 2] = #result .. '|' .. suffix
  filed_sizes[#filed_sizes + 1] = #result
end

-- Index what this call filed, evict past the most entries, count the bytes.
local function cache_index()
  if #filed == 0 and cache_delta == 0 then return end
  if #filed > 0 then
    local added = redis.call('ZADD', K_CACHEX, 'NX', unpack(filed))
    if added == #filed_sizes then
      for _, size in ipairs(filed_sizes) do cache_delta = cache_delta + size end
    else
      -- some were indexed already (an expired entry not swept yet: counted already);
      -- the new ones are those with this call's score; refresh the others' expiry
      local members = {}
      for j = 2, #filed, 2 do members[#members + 1] = filed[j] end
      local scores = redis.call('ZMSCORE', K_CACHEX, unpack(members))
      for j = 1, #members do
        if tonumber(scores[j]) == filed[2 * j - 1] then
          cache_delta = cache_delta + filed_sizes[j]
        end
      end
      redis.call('ZADD', K_CACHEX, 'XX', unpack(filed))
    end
    local over = redis.call('ZCARD', K_CACHEX) - cache_max
    if over > 0 then
      local popped = redis.call('ZPOPMIN', K_CACHEX, over)
      local gone = {}
      for j = 1, #popped, 2 do gone[#gone + 1] = popped[j] end
      cache_delta = cache_delta - cache_drop(gone)
    end
  end
  if cache_delta ~= 0 then redis.call('HINCRBY', K_STATS, 'cache_bytes', cache_delta) end
end

for i = 0, n - 1 do
  local b = 5 + i * 3
  local id, token = ARGV[b], ARGV[b + 1]
  local f = redis.call('HMGET', K_TASK .. id, 'status', 'token', 'stream', 'cache')
  if f[1] ~= 'running' or f[2] ~= token then
    codes[i + 1] = E_LEASE_LOST
  else
    redis.call('ZREM', K_LEASES, id)
    if f[4] then cache_put(id, f[4], ARGV[b + 2]) end
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
cache_index()
if woken > 0 then nudge() end
flush_replies()
return codes
