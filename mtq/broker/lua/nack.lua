--[[ nack.lua -- settle tasks that did not succeed, fenced by lease token.
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] retention s   ARGV[4] dead-letter retention s   ARGV[5] dead-letter max length
ARGV[6] n, then n groups of 4: id, lease token, action, delay ms / error
  An error may be followed by a NUL and the traceback, stored in 'traceback'.
  action 'retry'   : attempts+1, status 'delayed', due after the delay; its stream
                     stays busy, so the retry runs before anything behind it.
                     The 4th field is "<delay ms>|<error>".
  action 'fail'    : attempts+1, terminal 'failed' with the error.
  action 'dead'    : attempts+1, terminal 'dead', id pushed on the dead-letter list.
  action 'cancel'  : terminal 'cancelled' (the worker stopped it on request).
  action 'release' : give the task back unrun: head of its stream, delivery not counted.
  action 'requeue' : the process running it died or was killed (a supervisor reports
                     it): as if its lease expired now -- head of its stream with the
                     delivery counted, or dead as poison at the delivery limit.
                     The 4th field is "<max deliveries>|<reason>".
  A task with a pending cancel request ends cancelled whatever the action (the
  user's intent wins; it does not land in the dead-letter list).
ARGV[7 + 4n] the costs the tasks really had, "index=cost,..." (as in ack.lua)
Returns: one code per task: 1 = done; E_LEASE_LOST (not running under this token,
  nothing changed); E_BAD_ARGUMENT (unknown action, nothing changed).
]]
--@include _lib.lua
local ttl, dead_ttl, dead_max, n = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()
local reported = ARGV[7 + 4 * n]
local costs = (reported and reported ~= '') and sch().costs_of(reported) or false
local codes, woken = {}, 0
local by = {retried = {}, failed = {}, dead = {}, cancelled = {}, released = {}}
by.reclaimed = {requeued = {}, dead = {}, cancelled = {}}
for i = 0, n - 1 do
  local b = 7 + i * 4
  local id, token, action, arg = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
  local tk = K_TASK .. id
  local f = redis.call('HMGET', tk, 'status', 'token', 'stream', 'cancel', 'deliveries', 'reply', 'out',
    'weight')
  local s = f[3]
  if f[1] ~= 'running' or f[2] ~= token then
    codes[i + 1] = E_LEASE_LOST
  elseif action ~= 'retry' and action ~= 'fail' and action ~= 'dead' and action ~= 'cancel'
      and action ~= 'release' and action ~= 'requeue' then
    codes[i + 1] = E_BAD_ARGUMENT
  elseif action == 'requeue' then
    redis.call('ZREM', K_LEASES, id)
    local sep = string.find(arg, '|', 1, true) or (#arg + 1)
    local limit = tonumber(string.sub(arg, 1, sep - 1)) or 1
    local what, woke = reclaim(id, {'running', s, f[5], f[4]}, now, limit, ttl, dead_ttl,
      dead_max, string.sub(arg, sep + 1))
    by.reclaimed[what][#by.reclaimed[what] + 1] = id
    woken = woken + woke
    codes[i + 1] = 1
  else
    redis.call('ZREM', K_LEASES, id)
    if f[8] then sch().uncount(f[8]) end  -- charged at its claim: counted running
    -- a task given back unrun costs nothing: its next claim charges it again
    local actual = action == 'release' and 0 or (costs and costs[i + 1])
    if actual and f[8] then
      sch().settle_cost(f[8], redis.call('HGET', tk, 'cost'), actual)
    end
    if f[4] then action = 'cancel' end  -- a pending cancel request wins over any outcome but success
    local nul = string.find(arg, '\0', 1, true)
    if nul and (action == 'retry' or action == 'fail' or action == 'dead') then
      redis.call('HSET', tk, 'traceback', string.sub(arg, nul + 1))
      arg = string.sub(arg, 1, nul - 1)
    end
    if action == 'retry' or action == 'release' then materialize(id) end  -- before the fields change
    if action == 'retry' then
      local sep = string.find(arg, '|', 1, true)
      local delay = tonumber(string.sub(arg, 1, sep - 1))
      redis.call('HSET', tk, 'status', 'delayed', 'error', string.sub(arg, sep + 1))
      redis.call('HINCRBY', tk, 'attempts', 1)
      redis.call('ZADD', K_DELAYED, now + delay, id)
      note(id, now, 'retry', 'in ' .. delay .. ' ms after: ' .. string.sub(arg, sep + 1, sep + 300))
      by.retried[#by.retried + 1] = id
      reply('restarted', f[6], id, tonumber(f[5] or '0'), 'retry after: ' .. string.sub(arg, sep + 1, sep + 200))
    elseif action == 'release' then
      redis.call('HSET', tk, 'deliveries', math.max(0, tonumber(f[5] or '1') - 1))
      requeue_head(id, s)
      note(id, now, 'released', 'given back unrun by its worker')
      woken = woken + 1
      by.released[#by.released + 1] = id
      -- a generation that had streamed tokens starts over (its stream goes on where it was)
      if f[7] or redis.call('EXISTS', K_OUT .. id) == 1 then
        reply('restarted', f[6], id, tonumber(f[5] or '1') - 1, 'released by its worker')
      else
        reply('queued', f[6], id)
      end
    else
      if action == 'cancel' then
        finish(id, 'cancelled', now, ttl)
        by.cancelled[#by.cancelled + 1] = id
      else
        redis.call('HINCRBY', tk, 'attempts', 1)
        if action == 'fail' then
          finish(id, 'failed', now, ttl, 'error', arg)
          by.failed[#by.failed + 1] = id
        else
          dead_letter(id, now, dead_ttl, dead_max, arg)
          by.dead[#by.dead + 1] = id
        end
      end
      if s then woken = woken + release_stream(s) end
    end
    codes[i + 1] = 1
  end
end
reclaim_events(by.reclaimed, now)
by.reclaimed = nil
for name, ids in pairs(by) do
  if #ids > 0 then
    if name ~= 'released' and name ~= 'dead' then redis.call('HINCRBY', K_STATS, name, #ids) end
    event(name, now, {ids = ids})
  end
end
-- A retry becomes due later: wake a sleeper so it re-reads the timers.
if woken > 0 or #by.retried > 0 then nudge() end
flush_replies()
return codes
