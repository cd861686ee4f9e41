--[[ ack.lua -- record the results of a batch, fenced by lease token.
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] retention s   ARGV[4] n, then n groups of 3: id, lease token, result (msgpack)
ARGV[5 + 3n] result cache TTL s (0 = off)
ARGV[6 + 3n] the model version the acking worker serves ('' = not known here, as in a
  generator's outlet process: only the queue's model record is checked)
ARGV[7 + 3n] the costs the tasks really had, "index=cost,..." (index from 1; absent or
  '': none reported): settled against what their claim charged (see _lib.lua)
A task with a cancel request (cancel.lua set 'cancel' while it ran: the request may
reach Redis after its worker's last lease extend) never ends succeeded: it ends
cancelled, its result dropped (read in the HMGET done anyway: no extra command).
Returns: one code per task: 1 = recorded; 2 = ended cancelled instead (as above);
  3 = recorded, and the task is a step of a chain with a step after it ('then' in its
  hash): its id entered K_HANDOFFS (scored now) in this same call, so the next step is
  submitted exactly once even if the worker dies before it does so itself (see
  mtq/broker/chains.py: the worker submits it and removes the record; recovery
  completes records a dead worker left); its stream (if it has one) is not released:
  it stays busy, as if the task still ran, until handed.lua completes the record, so
  that no later task of the stream runs (and hands off) before this one's hand-off
  (K_HELD, id -> stream, says what to release); after the n codes,
  one entry per such task:
  {id, its 'then', its 'chain', its 'reply' or ''}, what the worker's hand-off needs
  (it has the result: it sent it);
  E_LEASE_LOST = the task is not running
  under this token any more (its lease expired and it was reclaimed, or it was
  already finished): nothing is changed, the result of the current owner stands.
Result cache (see submit.lua): a task that owns a cache entry ('cache' = version ..
':' .. digest) answers identical requests from its own hash once it succeeded, so
filing it costs no command: its retention is raised to the cache TTL if that is
longer. Only if its version is no longer the queue's model version (K_MODEL) or the
acking worker's (a fleet half way through a reload must not answer the new model's
requests with an old model's result), or its result is over REPLY_INLINE bytes (a hit
answers inline, in one round trip), is its entry deleted (finish() does it).
]]
--@include _lib.lua
local ttl, n = tonumber(ARGV[3]), tonumber(ARGV[4])
local cache_ttl, version = tonumber(ARGV[5 + 3 * n]), ARGV[6 + 3 * n]
local reported = ARGV[7 + 3 * n]
local costs = (reported and reported ~= '') and sch().costs_of(reported) or false
local now = now_ms()
local codes, done, woken = {}, {}, 0
local cancelled = {}  -- a cancel request came first (see the header)
local chained = {}  -- {id, then, chain, reply} of each task whose hand-off is recorded
local ended = nil  -- the charge ('weight') of each task a scheduling claim charged -> how many
-- A succeeded task's entry may answer identical requests (see the header) if this is
-- true, its result is small enough, and its entry's version is the queue's model
-- version (its suffix starts with prefix).
local keepable, prefix = false, nil
if cache_ttl > 0 then
  local model_version = redis.call('HGET', K_MODEL, 'version') or ''
  keepable = model_version ~= '' and (version == '' or version == model_version)
  prefix = model_version .. ':'
end

for i = 0, n - 1 do
  local b = 5 + i * 3
  local id, token = ARGV[b], ARGV[b + 1]
  -- reply, created, trace, out first: finish() takes them as they are (no table a task);
  -- 'weight': a claim with scheduling on charged it (its lane counts it running)
  local f = redis.call('HMGET', K_TASK .. id, 'reply', 'created', 'trace', 'out', 'status', 'token',
    'stream', 'cache', 'weight', 'cancel', 'then', 'chain')
  if f[5] ~= 'running' or f[6] ~= token then
    codes[i + 1] = E_LEASE_LOST
  elseif f[10] then
    if costs and costs[i + 1] then
      sch().settle_cost(f[9], redis.call('HGET', K_TASK .. id, 'cost'), costs[i + 1])
    end
    if f[9] then sch().uncount(f[9]) end
    finish(id, 'cancelled', now, ttl, nil, nil, f[8] or false, f)
    if f[7] then woken = woken + release_stream(f[7]) end
    redis.call('ZREM', K_LEASES, id)
    cancelled[#cancelled + 1] = id
    codes[i + 1] = 2
  else
    local keep, own, result = ttl, f[8] or false, ARGV[b + 2]
    -- find, plain, not sub: no new string per task
    if own and keepable and #result <= REPLY_INLINE and string.find(own, prefix, 1, true) == 1 then
      own = false  -- its entry answers from now on: finish() leaves it
      keep = math.max(ttl, cache_ttl)
    end
    if costs and costs[i + 1] then
      sch().settle_cost(f[9], redis.call('HGET', K_TASK .. id, 'cost'), costs[i + 1])
    end
    if f[9] then  -- counted out of its lane's running below, once per lane
      ended = ended or {}
      ended[f[9]] = (ended[f[9]] or 0) + 1
    end
    finish(id, 'succeeded', now, keep, 'result', result, own, f)
    if f[11] then  -- a chain's step with one after it (one field more in the HMGET above)
      redis.call('ZADD', K_HANDOFFS, now, id)
      -- its stream stays held (busy: not claimable) until its hand-off is complete
      -- (handed.lua releases it), so the next queue gets the stream's steps in order
      -- (HSETNX: the same one command; an id reused after its task's retention ran out
      -- while its old record waited replaces that record, and releases its hold: the
      -- reaper would have dropped it, and nothing would release it once replaced)
      if f[7] and redis.call('HSETNX', K_HELD, id, f[7]) == 0 then
        local was = redis.call('HGET', K_HELD, id)
        if was ~= f[7] then
          redis.call('HSET', K_HELD, id, f[7])
          woken = woken + release_stream(was)
        end
      end
      codes[i + 1] = 3
      chained[#chained + 1] = {id, f[11], f[12] or '', f[1] or ''}
    else
      if f[7] then woken = woken + release_stream(f[7]) end
      codes[i + 1] = 1
    end
    done[#done + 1] = id
  end
end
if #done > 0 then
  for i = 1, #done, 4000 do
    redis.call('ZREM', K_LEASES, unpack(done, i, math.min(i + 3999, #done)))
  end
  redis.call('HINCRBY', K_STATS, 'succeeded', #done)
  event('succeeded', now, {ids = done})
end
if #cancelled > 0 then
  redis.call('HINCRBY', K_STATS, 'cancelled', #cancelled)
  event('cancelled', now, {ids = cancelled})
end
if ended then
  for charged, k in pairs(ended) do sch().uncount(charged, k) end
end
if woken > 0 then nudge() end
flush_replies()
for _, c in ipairs(chained) do codes[#codes + 1] = c end
return codes
