--[[ cancel.lua -- cancel one task.
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] task id   ARGV[4] retention s
Returns: {1, previous status} cancelled now (it was queued, or waiting for a retry or
  its delay (out of the delayed set);
  a queued id stays in its list as a tombstone that claim skips, so cancelling is
  O(1) and the tasks behind it are not held up; its hash starts its retention
  only when claim pops the tombstone, so the id cannot be reused before);
  {2, 'running'} a running task: a cancel is requested and its worker is told at
  once on the control channel ({"cmd": "cancel", "ids": [id], "worker": w}); it
  stops the work (a generator at its next step, a function or model that checks
  mtq.current_task() at its next check) and never records a success for it (nor
  does ack.lua, which ends a task with 'cancel' set cancelled); a worker that
  missed the message learns it on its next heartbeat (extend);
  {E_NOT_FOUND, ''} no such task (never existed, or its retention ran out);
  {E_FINISHED, status} already in a terminal state; nothing changed.
]]
--@include _lib.lua
local id, ttl = ARGV[3], tonumber(ARGV[4])
local now = now_ms()
local f = redis.call('HMGET', K_TASK .. id, 'status', 'stream', 'worker', 'due')
local status, s = f[1], f[2]
if not status then return {E_NOT_FOUND, ''} end
if status == 'queued' then
  redis.call('HINCRBY', K_STATS, 'waiting', -1)
  if sched_on() then
    local l = redis.call('HMGET', K_TASK .. id, 'band', 'tenant', 'cost')
    sch().lane_count(l[1], l[2], -1, -tonumber(l[3] or '1'), 0)
  end
elseif status == 'delayed' then
  redis.call('ZREM', K_DELAYED, id)
  -- a retry kept its stream busy; a delayed submit ('due') holds nothing up
  if s and not f[4] and release_stream(s) == 1 then nudge() end
elseif status == 'running' then
  redis.call('HSET', K_TASK .. id, 'cancel', '1')
  note(id, now, 'cancel requested', 'its worker is told')
  event('cancel_requested', now, {ids = {id}})
  redis.call(PUBLISH, CONTROL, cjson.encode({cmd = 'cancel', ids = {id}, worker = f[3] or ''}))
  return {2, status}
else
  return {E_FINISHED, status}
end
-- A queued task's id stays in its list as a tombstone: keep the hash (no expiry)
-- until claim pops the tombstone, so the id cannot be reused while it exists.
if status == 'queued' then finish(id, 'cancelled', now, 0) else finish(id, 'cancelled', now, ttl) end
redis.call('HINCRBY', K_STATS, 'cancelled', 1)
event('cancelled', now, {ids = {id}})
flush_replies()
return {1, status}
