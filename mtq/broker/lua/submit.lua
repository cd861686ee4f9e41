--[[ submit.lua -- enqueue one or many tasks in one call.
KEYS: the standard nineteen (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] max_length (0 = unbounded)   ARGV[4] wake cap   ARGV[5] idempotency window (s)
ARGV[6] reply channel of the submitting client ('' = none; stored in each task)
ARGV[7] n, then n groups of 8: id, payload, stream ('' = none), key ('' = none),
        ttl_ms (0 = no deadline), retries ('' = the worker's default),
        digest (the result cache's digest of the payload, '' = do not cache),
        traceparent (W3C trace context of the submitting request, '' = none)
Returns: a list with one entry per task: its id (for an idempotency hit, the id
  of the task that already holds the key) or E_DUPLICATE_ID when the id exists.
  Or {E_QUEUE_FULL, waiting} when the n tasks would not fit (nothing is written).
]]
--@include _lib.lua
local max_length, cap, window, n = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[7])
local reply_to = ARGV[6]
local now = now_ms()
if max_length > 0 then
  local waiting = tonumber(redis.call('HGET', K_STATS, 'waiting') or '0')
  if waiting + n > max_length then return {E_QUEUE_FULL, waiting} end
end
local out, added, newly, new_streams = {}, 0, 0, 0
for i = 0, n - 1 do
  local b = 8 + i * 8
  local id, payload, s, key, ttl, retries = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4], ARGV[b + 5]
  local digest, traceparent = ARGV[b + 6], ARGV[b + 7]
  local tk = K_TASK .. id
  local existing = false
  if key ~= '' then existing = redis.call('GET', K_IDEM .. key) end
  if existing then
    out[i + 1] = existing
  elseif redis.call('EXISTS', tk) == 1 then
    out[i + 1] = E_DUPLICATE_ID
  else
    local f = {'payload', payload, 'status', 'queued', 'created', now}
    if s ~= '' then f[#f + 1] = 'stream'; f[#f + 1] = s end
    if key ~= '' then
      f[#f + 1] = 'key'; f[#f + 1] = key
      redis.call('SET', K_IDEM .. key, id, 'EX', window)
    end
    if ttl ~= '0' then f[#f + 1] = 'deadline'; f[#f + 1] = now + tonumber(ttl) end
    if retries ~= '' then f[#f + 1] = 'retries'; f[#f + 1] = retries end
    if reply_to ~= '' then f[#f + 1] = 'reply'; f[#f + 1] = reply_to end
    if traceparent ~= '' then f[#f + 1] = 'traceparent'; f[#f + 1] = traceparent end
    redis.call('HSET', tk, unpack(f))
    note(id, now, 'queued', s ~= '' and ('stream ' .. s) or nil)
    local claimable, new_stream = push_tail(id, s)
    newly, new_streams = newly + claimable, new_streams + new_stream
    added = added + 1
    out[i + 1] = id
    reply('queued', reply_to, id)
  end
end
if added > 0 then
  redis.call('HINCRBY', K_STATS, 'waiting', added)
  redis.call('HINCRBY', K_STATS, 'submitted', added)
  if new_streams > 0 then redis.call('HINCRBY', K_STATS, 'streams', new_streams) end
  wake(newly, cap)
  event('queued', now, {n = added})
end
flush_replies()
return out
