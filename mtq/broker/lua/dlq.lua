--[[ dlq.lua -- retry or purge dead letters.
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] action: 'retry' | 'purge'   ARGV[4] limit   ARGV[5] wake cap
ARGV[6] n, then n ids (n = 0: the oldest `limit` dead letters)
  retry: the task is queued again at the TAIL of its stream (after what was
         submitted since it died; its stream's order among live tasks holds),
         attempts and deliveries reset, error and old output cleared, retention
         lifted; its client (if still listening) sees 'queued' again.
  purge: the task, its output and its trace are deleted.
Ids that are not in the dead-letter list are skipped.
Returns: {done, more} (more = 1 if dead letters may remain beyond the limit).
]]
--@include _lib.lua
local action, limit, cap, n = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if action ~= 'retry' and action ~= 'purge' then return {E_BAD_ARGUMENT, 0} end
local now = now_ms()
local ids = {}
if n == 0 then
  ids = redis.call('LRANGE', K_DEAD, -limit, -1)  -- oldest last in the list
else
  for i = 1, n do ids[i] = ARGV[6 + i] end
end
local done, newly, new_streams, requeued = 0, 0, 0, {}
for _, id in ipairs(ids) do
  if redis.call('LREM', K_DEAD, 0, id) > 0 then
    local tk = K_TASK .. id
    if action == 'purge' then
      redis.call('DEL', tk, K_OUT .. id, K_TRACE .. id)
    elseif redis.call('HGET', tk, 'status') == 'dead' then
      materialize(id)  -- its life so far, before the fields it is read from are cleared
      redis.call('HSET', tk, 'status', 'queued', 'attempts', 0, 'deliveries', 0)
      redis.call('HDEL', tk, 'error', 'traceback', 'finished', 'started', 'token', 'worker', 'cancel',
        'out')
      redis.call('PERSIST', tk)
      redis.call('PERSIST', K_TRACE .. id)
      redis.call('DEL', K_OUT .. id)
      note(id, now, 'queued', 'retried from the dead letters')
      local sf = redis.call('HMGET', tk, 'stream', 'band', 'tenant', 'cost')
      local claimable, new_stream = push_tail(id, sf[1], sf[2], sf[3])
      if sched_on() then sch().lane_count(sf[2], sf[3], 1, tonumber(sf[4] or '1'), 0) end
      newly, new_streams = newly + claimable, new_streams + new_stream
      reply('queued', redis.call('HGET', tk, 'reply'), id)
      requeued[#requeued + 1] = id
    end
    done = done + 1
  end
end
if #requeued > 0 then
  redis.call('HINCRBY', K_STATS, 'waiting', #requeued)
  if new_streams > 0 then redis.call('HINCRBY', K_STATS, 'streams', new_streams) end
  wake(newly, cap)
  event('queued', now, {ids = requeued, from = 'dead letters'})
end
flush_replies()
return {done, (n == 0 and #ids >= limit) and 1 or 0}
