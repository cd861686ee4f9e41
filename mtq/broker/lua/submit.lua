--[[ submit.lua -- enqueue one or many tasks in one call.
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] max_length (0 = unbounded)   ARGV[4] wake cap   ARGV[5] idempotency window (s)
ARGV[6] reply channel of the submitting client ('' = none; stored in each task)
ARGV[7] n   ARGV[8] G, the ARGV per task: 8, or 12 with the scheduling fields; one more
  (9 or 13) with a run timeout, last in each group
ARGV[9] retention s (of a task answered from the result cache)
ARGV[10] result cache TTL s   ARGV[11] most cache entries
ARGV[12] how long an entry may point at a task still queued or running (s)
ARGV[13] the tenants' weights, "tenant=weight,..." (a task handed to a sleeping
  worker is charged as a claim would charge it)
ARGV[14], ARGV[15] the tenants' rate limits, requests and cost per minute
  ("tenant=N,...,*=N", see _lib.lua)   ARGV[16] 'reject' or 'hold'
ARGV[17...] n groups of G: id, payload, stream ('' = none), key ('' = none),
        ttl_ms (0 = no deadline), retries ('' = the worker's default),
        digest (the result cache's digest of the payload, '' = do not cache),
        traceparent (W3C trace context of the submitting request, '' = none);
        with G = 12, then: band ('i', 's' or 'b'), tenant ('' = none), cost ('' = 1),
        admit ('1': its deadline is one to keep: refuse it if it would be missed)
        (G = 8: band 's', no tenant, cost 1, no deadline to keep); with G = 9 or 13,
        last: timeout (ms a run may take once started, '' = none; stored as 'timeout')
ARGV[17 + n * G] (present when a task of the call has a delay or a chain; '' = none)
  the tasks' delays in ms, comma separated, one per task (0 = none): see "Delayed submits"
ARGV[18 + n * G ...] (present when a task of the call is a step of a chain) two per task:
  its 'chain' field (msgpack: the chain's id, the step's index, every step's queue) and
  its 'then' field (msgpack: the steps after it), '' for none; stored as they are (see
  ack.lua and mtq/broker/chains.py)
Returns {handed, answer}: how many of the tasks went to a sleeping worker (direct
  delivery, below; the client then yields its CPU once, so that a worker it shares
  the CPU with runs the task before the client's own bookkeeping), and the answer: a
  list with one entry per task: its id (for an idempotency hit, the id
  of the task that already holds the key; for a single-flight join, the id of the
  identical task queued or running) or E_DUPLICATE_ID when the id exists, or
  {id, result} for a result-cache hit: the task was created succeeded, its result
  inline (and no done message is published: the submitter has it here). Or
  {E_QUEUE_FULL, waiting} when the n tasks would not fit, {E_RATE_LIMITED, retry after
  ms, tenant} when a tenant's tasks are over its rate limit (reject mode), or
  {E_WOULD_MISS, retry after ms, id} when a task with a deadline to keep would start
  after it (see _lib.lua); nothing is written then but the refusals' count.

Direct delivery (see _lib.lua): a task that would be claimable at once (stream-less
while the free list is empty, or the head of an empty stream that is not busy) goes to
a worker registered idle in K_IDLE, if one is, up to its room (what its slot could take:
the most one call hands it; the next task goes to the next registration): written
running under a lease token of this call, as claim.lua would leave it, and pushed to
the worker's inbox as one claim reply (an msgpack array of claim.lua's 9 entries per
task) per worker. Its registration stays as it is until its window ends, a call hands
it its whole room, or a hand-off finds the one before it still in the inbox (the
worker did not come back to its BLPOP: it died, or is frozen or busy).
It is not counted waiting, sends the events channel 'started' ({ids, worker}) but its
client nothing (see hand()), and costs no wake-up marker.

Delayed submits: a task with a delay is not queued, handed nor counted waiting: its
hash is written as for a queued task but 'delayed', with 'due' (now + delay) and a
deadline of due + ttl, and it enters K_DELAYED, the retries' set, which claim.lua and
reap.lua promote from (enqueue_due in _lib.lua: when due it joins the tail of its
stream). A call that makes the set's first entry earlier wakes a sleeper, which then
reads the new timer. The client sends no digest (no result cache) and no deadline to
keep with a delay.

Result cache (see docs/operations.md): a digest is 'c' or 'u' (the payload has no
integer seed) then the hex digest of the payload. It is used only if the queue's
model record (K_MODEL) has a version, and, for a generator, the request is seeded
('c') or the model deterministic; and never when the model set cacheable 0. The
entry K_CACHE .. version .. ':' .. hex holds the id of the task that runs (or ran)
that request; the result stays in that task's hash (no copy). A submit that finds
it answers from the task if it succeeded within the TTL and names this entry
('cache' field: anything else is a corrupt entry, a miss), joins it if it is queued,
running or delayed, and otherwise takes the entry over. So a miss costs a GET and a
SET here (the index once per call) and nothing in ack.lua; finish() deletes an
entry whose task ends otherwise than succeeded.
]]
--@include _lib.lua
local max_length, cap, window, n = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[7])
local reply_to = ARGV[6]
local G = tonumber(ARGV[8])  -- ARGV per task
local retention, cache_ttl = tonumber(ARGV[9]), tonumber(ARGV[10])
local cache_max, run_ttl = tonumber(ARGV[11]), tonumber(ARGV[12])
local A = 17  -- the first task's ARGV
local weights = nil  -- tenant -> weight, read at the first hand-off with scheduling on
local now = now_ms()
-- the tasks' delays (ms, by task index from 0), when the call has any (see the header)
local delays = nil
if ARGV[A + n * G] and ARGV[A + n * G] ~= '' then
  delays = {}
  local i = 0
  for x in string.gmatch(ARGV[A + n * G], '[^,]+') do
    delays[i] = tonumber(x) or 0
    i = i + 1
  end
end
local chained = ARGV[A + n * G + 1] ~= nil  -- the call's tasks have chain fields
local due = {}  -- score, member pairs for K_DELAYED
local dseq = nil  -- the call's first submit-order number for delayed tasks
-- (a refused call writes nothing: checked before scheduling is turned on)
if max_length > 0 then
  local waiting = tonumber(redis.call('HGET', K_STATS, 'waiting') or '0')
  if waiting + n > max_length then return {0, {E_QUEUE_FULL, waiting}} end
end
local sched_args = G >= 12
local timed = G == 9 or G == 13  -- each group ends with a run timeout
local rpm, tpm, hold, limited = nil, nil, false, false
if sched_args then
  rpm, tpm = sch().limits_of(ARGV[14]), SCH.limits_of(ARGV[15])
  hold = ARGV[16] == 'hold'
  limited = next(rpm) ~= nil or next(tpm) ~= nil
end
local admitting = false  -- a task with a deadline to keep
for i = 0, sched_args and n - 1 or -1 do
  local b = A + i * G
  if ARGV[b + 11] == '1' then admitting = true end
end
-- Refused whole, with the refusals counted per lane: ids are the task groups' indexes.
local function refuse(code, after, what, idx)
  if sched_on() then
    local ck = K_SCHED .. 'count'
    for _, i in ipairs(idx) do
      local b = A + i * G
      redis.call('HINCRBY', ck, ARGV[b + 8] .. ':' .. ARGV[b + 9] .. '|x', 1)
    end
  end
  return {0, {code, after, what}}
end

-- Rate limits, reject mode: the call's tasks of each limited tenant, all or none.
if limited and not hold then
  local per, order = {}, {}
  for i = 0, n - 1 do
    local b = A + i * G
    local t = ARGV[b + 9]
    if t ~= '' then
      if not per[t] then
        per[t] = {0, 0, {}}
        order[#order + 1] = t
      end
      local e = per[t]
      e[1], e[2] = e[1] + 1, e[2] + (tonumber(ARGV[b + 10]) or 1)
      e[3][#e[3] + 1] = i
    end
  end
  for _, t in ipairs(order) do
    -- the call goes in when its first task may, and counts all of them: a call of more
    -- than the limit's burst makes the tenant wait that much longer after it (one that
    -- waited for all of them at once would never go in)
    local wait = SCH.rate_wait(t, 1, now, rpm, tpm)
    if wait > 0 then
      local all = {}
      for i = 0, n - 1 do all[#all + 1] = i end
      return refuse(E_RATE_LIMITED, wait, t, all)
    end
  end
  for _, t in ipairs(order) do SCH.rate_charge(t, per[t][1], per[t][2], now, rpm, tpm) end
end

-- Deadline admission (see _lib.lua): the cost waiting ahead of each such task, at the
-- measured service rate, must let it start before its deadline.
local ADMIT_MARGIN = 1.1
if admitting then
  local meter = redis.call('HGET', K_SCHED .. 'vt', '~rate')
  local rate = tonumber(meter or '0')  -- cost per second; 0: not measured yet (admit)
  if rate > 0 then
    local w8 = sch().weights_of(ARGV[13])
    local ck = K_SCHED .. 'count'
    local added = {}  -- cost this call adds ahead, per lane
    for i = 0, n - 1 do
      local b = A + i * G
      local band, t, cost = ARGV[b + 8], ARGV[b + 9], tonumber(ARGV[b + 10]) or 1
      local lk = band .. ':' .. t
      if ARGV[b + 11] == '1' then
        -- higher bands go first; in its band, each other tenant o is served about
        -- min(its waiting cost, ours * w_o / w_t) before our tenant's work is done
        local ahead = 0
        for _, hb in ipairs(SCH.BANDS) do
          if hb == band then break end
          ahead = ahead + tonumber(redis.call('HGET', ck, hb .. '|c') or '0')
        end
        local own = tonumber(redis.call('HGET', ck, lk .. '|c') or '0') + (added[lk] or 0)
        local wt = w8[t] or 1
        local others = redis.call('ZRANGE', K_SCHED .. 'band:' .. band, 0, 99)
        local fields = {}
        for _, o in ipairs(others) do
          if o ~= t then fields[#fields + 1] = band .. ':' .. o .. '|c' end
        end
        if #fields > 0 then
          local costs = redis.call('HMGET', ck, unpack(fields))
          for j, c in ipairs(costs) do
            local o = string.sub(fields[j], 3, -3)
            ahead = ahead + math.min(tonumber(c or '0'), own * (w8[o] or 1) / wt)
          end
        end
        ahead = ahead + own
        -- with a margin of ADMIT_MARGIN for the rate's error (it is an average over
        -- windows of 2 s: the backlog of an overloaded queue sits at the deadline)
        local start_in = ahead * 1000 / rate * ADMIT_MARGIN
        local ttl_ms = tonumber(ARGV[b + 4])
        if start_in > ttl_ms then
          local all = {}
          for j = 0, n - 1 do all[#all + 1] = j end
          return refuse(E_WOULD_MISS, math.ceil(start_in - ttl_ms), ARGV[b], all)
        end
      end
      added[lk] = (added[lk] or 0) + cost
    end
  end
end
-- The first task with a band, a tenant or a deadline to keep turns scheduling on (see
-- _lib.lua; after the refusals above: a refused call turns nothing on)
for i = 0, sched_args and n - 1 or -1 do
  local b = A + i * G
  if ARGV[b + 8] ~= 's' or ARGV[b + 9] ~= '' or ARGV[b + 11] == '1' then
    if not sched_on() then
      redis.call('HSET', K_STATS, 'sched', '1')
      SCHED_ON = true
      if redis.call('LLEN', K_READY) > 0 then sch().activate('s', '') end
      -- the lane ('s', '') holds every task so far: its waiting count starts from the
      -- queue's, each task's cost 1 (a task stores its cost only once the queue schedules,
      -- below); those running were not charged, and are not counted running
      local waiting = tonumber(redis.call('HGET', K_STATS, 'waiting') or '0')
      sch().lane_count('s', '', waiting, waiting, 0)
    end
    break
  end
end

local deadlines = false  -- score, member pairs for K_SCHED .. 'deadlines'
local out, added, newly, new_streams = {}, 0, 0, 0
local model, hits, cached_ids, misses, joined = nil, 0, {}, 0, 0
local indexed = {}  -- score, member pairs: the entries this call points at new tasks

-- Direct delivery (see the header): the live registrations, read at the first task that
-- could go to one (nil: not read yet); each {worker, lease ms, room left in this call,
-- claim reply, ids, the queue schedules (its registration ends "|s")}
local idle, at, handed = nil, 1, 0
local free_empty = nil  -- the free list is known empty (nil: not read yet)
local base = false      -- lease tokens, taken once for the whole call
local leases = {'+inf', LEASE_MARK}  -- the handed tasks' leases (see add_leases)
-- the stream-less tasks queued, in order: one RPUSH to the free list for all of them
local free_ids = {}

-- The registered worker that takes the next task, or nil.
local function idle_worker()
  if not idle then
    idle = {}
    local all, stale = redis.call('HGETALL', K_IDLE), {}
    for j = 1, #all, 2 do
      local expiry, lease, room, sched = string.match(all[j + 1], '^(%d+)|(%d+)|(%d+)(.*)$')
      if expiry and tonumber(expiry) > now then
        idle[#idle + 1] = {all[j], tonumber(lease), tonumber(room), {}, {}, sched == '|s'}
      else
        stale[#stale + 1] = all[j]  -- its worker did not come back: stopped, or died
      end
    end
    if #stale > 0 then redis.call('HDEL', K_IDLE, unpack(stale)) end
  end
  while idle[at] and idle[at][3] == 0 do at = at + 1 end
  return idle[at]
end

-- Would a task of stream s (or stream-less: '') of lane (b, t) be claimable at once?
local function deliverable(s, b, t)
  if s ~= '' then
    return redis.call('LLEN', K_STREAM .. s) == 0 and redis.call('SISMEMBER', K_BUSY, s) == 0
  end
  if b ~= 's' or t ~= '' then return redis.call('LLEN', sch().lane_free(b, t)) == 0 end
  if free_empty == nil then free_empty = redis.call('LLEN', K_FREE) == 0 end
  return free_empty
end

-- A task handed to a worker is charged as a claim charges it (scheduling on).
local function charge(b, t, cost)
  if not weights then weights = sch().weights_of(ARGV[13]) end
  local w = weights[t] or 1
  -- (the bands' sets keep its old time as their order: a claim reads the time itself)
  redis.call('HINCRBYFLOAT', K_SCHED .. 'vt', t, cost / w)
  redis.call('HINCRBYFLOAT', K_SCHED .. 'served', b .. ':' .. t, cost)
  return w
end

-- Write task id (fields f) running under worker w, as a claim of it would leave it.
local function hand(w, id, s, f, payload, retries, traceparent, timeout, lb, lt, cost)
  if not base then base = redis.call('INCRBY', K_SEQ, n) - n end  -- n tokens, for this call
  handed = handed + 1
  local token = tostring(base + handed)
  f[4] = 'running'
  f[#f + 1] = 'worker'; f[#f + 1] = w[1]
  f[#f + 1] = 'token'; f[#f + 1] = token
  f[#f + 1] = 'started'; f[#f + 1] = num(now)
  f[#f + 1] = 'deliveries'; f[#f + 1] = '1'
  if w[6] or SCHED_ON then  -- (see the call)
    f[#f + 1] = 'weight'
    f[#f + 1] = num(charge(lb, lt, cost)) .. '|' .. lb .. '|' .. lt
  end
  redis.call('HSET', K_TASK .. id, unpack(f))
  if s ~= '' then redis.call('SADD', K_BUSY, s) end
  leases[#leases + 1] = num(now + w[2])
  leases[#leases + 1] = id
  local r = w[4]
  local o = #r
  r[o + 1] = id; r[o + 2] = token; r[o + 3] = payload; r[o + 4] = s
  r[o + 5] = '0'; r[o + 6] = 1; r[o + 7] = retries; r[o + 8] = 0
  r[o + 9] = timeout ~= '' and traceparent .. '|' .. timeout or traceparent  -- (as claim.lua)
  w[5][#w[5] + 1] = id
  w[3] = w[3] - 1
  -- no 'started' message: its one reply channel is the submitter's, which has no feed of
  -- the task open before this call returns (a client's hub drops a non-terminal event
  -- nobody waits for), and no other client knows the id yet
end

-- The cache entry suffix of a digest (version .. ':' .. hex), or nil: not cacheable.
local function cache_suffix(digest)
  if not model then
    model = redis.call('HMGET', K_MODEL, 'version', 'kind', 'deterministic', 'cacheable')
  end
  local version = model[1]
  if not version or version == '' or model[4] == '0' then return nil end
  if string.sub(digest, 1, 1) == 'u' and model[2] == 'generator' and model[3] ~= '1' then
    return nil
  end
  return version .. ':' .. string.sub(digest, 2)
end

-- What the cache holds for a suffix: the result of the task it names (succeeded
-- within the TTL), or the id of that task still queued, running or delayed; nil, nil
-- for nothing usable (the caller's own task takes the entry over).
local function cache_get(suffix)
  local owner = redis.call('GET', K_CACHE .. suffix)
  if not owner then return nil, nil end
  local f = redis.call('HMGET', K_TASK .. owner, 'status', 'result', 'finished', 'cache')
  if f[4] ~= suffix then return nil, nil end  -- gone, or not this entry's: corrupt
  if f[1] == 'succeeded' then
    if f[2] and f[3] and now - tonumber(f[3]) <= cache_ttl * 1000 then return f[2], nil end
    return nil, nil
  end
  if f[1] == 'queued' or f[1] == 'running' or f[1] == 'delayed' then return nil, owner end
  return nil, nil
end

for i = 0, n - 1 do
  local b = A + i * G
  local id, payload, s, key, ttl, retries = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4], ARGV[b + 5]
  local digest, traceparent = ARGV[b + 6], ARGV[b + 7]
  local delay = delays and delays[i] or 0
  local timeout = timed and ARGV[b + G - 1] or ''
  local band, tenant, cost = 's', '', ''
  if sched_args then band, tenant, cost = ARGV[b + 8], ARGV[b + 9], ARGV[b + 10] end
  -- rate limits held: a task of a tenant over its limit waits for a claim to allow it
  local held = hold and limited and tenant ~= '' and SCH.rate_wait(tenant, 1, now, rpm, tpm) > 0
  local tk = K_TASK .. id
  local existing = false
  if key ~= '' then existing = redis.call('GET', K_IDEM .. key) end
  if existing then
    out[i + 1] = existing
  elseif redis.call('EXISTS', tk) == 1 then
    out[i + 1] = E_DUPLICATE_ID
  else
    local suffix, hit, running = nil, nil, nil
    if digest ~= '' then
      suffix = cache_suffix(digest)
      if suffix then hit, running = cache_get(suffix) end
    end
    if hit then
      -- the task as finish() would leave it, in one HSET (a hit is the cache's hot
      -- path): succeeded, its result, its retention, a latency of 0; its trace is read
      -- from these fields ('cached'). No
      -- done message: the submitter has the result in this reply, and nobody else
      -- knows the new id yet (the reply channel is stored for a retried submit)
      local f = {'payload', payload, 'status', 'succeeded', 'created', num(now),
                 'finished', num(now), 'result', hit, 'cached', suffix, 'trace', '0'}
      if s ~= '' then f[#f + 1] = 'stream'; f[#f + 1] = s end
      if key ~= '' then
        f[#f + 1] = 'key'; f[#f + 1] = key
        redis.call('SET', K_IDEM .. key, id, 'EX', window)
      end
      if reply_to ~= '' then f[#f + 1] = 'reply'; f[#f + 1] = reply_to end
      redis.call('HSET', tk, unpack(f))
      if retention > 0 then redis.call('EXPIRE', tk, retention) end
      LATENCIES[#LATENCIES + 1] = 0
      hits = hits + 1
      cached_ids[hits] = id
      out[i + 1] = {id, hit}
    elseif running then
      if key ~= '' then redis.call('SET', K_IDEM .. key, running, 'EX', window) end
      joined = joined + 1
      out[i + 1] = running
    else
    -- 'trace' '0': its trace is read from its fields until it leaves the happy path
    local f = {'payload', payload, 'status', 'queued', 'created', num(now), 'trace', '0'}
    if s ~= '' then f[#f + 1] = 'stream'; f[#f + 1] = s end
    if key ~= '' then
      f[#f + 1] = 'key'; f[#f + 1] = key
      redis.call('SET', K_IDEM .. key, id, 'EX', window)
    end
    if delay > 0 then
      f[4] = 'delayed'
      f[#f + 1] = 'due'; f[#f + 1] = now + delay
      -- its place among tasks due at the same ms (promote_due): this call's block of seq
      if not dseq then dseq = redis.call('INCRBY', K_SEQ, n) - n end
      f[#f + 1] = 'dseq'; f[#f + 1] = dseq + i + 1
    end
    if ttl ~= '0' then f[#f + 1] = 'deadline'; f[#f + 1] = now + delay + tonumber(ttl) end
    if retries ~= '' then f[#f + 1] = 'retries'; f[#f + 1] = retries end
    if reply_to ~= '' then f[#f + 1] = 'reply'; f[#f + 1] = reply_to end
    if traceparent ~= '' then f[#f + 1] = 'traceparent'; f[#f + 1] = traceparent end
    if timeout ~= '' then f[#f + 1] = 'timeout'; f[#f + 1] = timeout end
    if chained then
      local c, nxt = ARGV[A + n * G + 1 + 2 * i], ARGV[A + n * G + 2 + 2 * i]
      if c ~= '' then f[#f + 1] = 'chain'; f[#f + 1] = c end
      if nxt ~= '' then f[#f + 1] = 'then'; f[#f + 1] = nxt end
    end
    if band ~= 's' then f[#f + 1] = 'band'; f[#f + 1] = band end
    if tenant ~= '' then f[#f + 1] = 'tenant'; f[#f + 1] = tenant end
    -- its cost matters to scheduling alone: stored if it is a lane's or the queue schedules
    -- (a task queued before it did counts 1 in the lane's cost, as the turn on counted it)
    if cost ~= '' and (band ~= 's' or tenant ~= '' or sched_on()) then
      f[#f + 1] = 'cost'; f[#f + 1] = cost
    end
    if suffix then
      -- last: the fields read on the hot path are found before it (a small hash is a
      -- listpack, searched from its head)
      f[#f + 1] = 'cache'; f[#f + 1] = suffix
      redis.call('SET', K_CACHE .. suffix, id, 'EX', cache_ttl + run_ttl)
      indexed[#indexed + 1] = now + (cache_ttl + run_ttl) * 1000
      indexed[#indexed + 1] = suffix
      misses = misses + 1
    end
    if delay > 0 then
      redis.call('HSET', tk, unpack(f))
      due[#due + 1] = now + delay
      due[#due + 1] = id
    else
    local w = not held and (idle == nil or idle[at]) and idle_worker()
    local handing = w and deliverable(s, band, tenant)
    if handing then
      -- a task handed to a worker is charged and counted running if the queue schedules:
      -- as its registration says (the claim that made it read it; no read here), or as
      -- this call found
      if w[6] or SCHED_ON then sch().lane_count(band, tenant, 0, 0, 1) end
    elseif sched_on() then
      sch().lane_count(band, tenant, 1, tonumber(cost) or 1, 0)
    end
    if handing then
      hand(w, id, s, f, payload, retries, traceparent, timeout, band, tenant, tonumber(cost) or 1)
      if hold and limited then SCH.rate_charge(tenant, 1, tonumber(cost) or 1, now, rpm, tpm) end
    else
      if ttl ~= '0' then
        deadlines = deadlines or {}
        deadlines[#deadlines + 1] = now + tonumber(ttl)
        deadlines[#deadlines + 1] = id
      end
      redis.call('HSET', tk, unpack(f))
      if s == '' and band == 's' and tenant == '' then
        free_ids[#free_ids + 1] = id  -- pushed all at once, after the loop
        free_empty = false
      else
        local claimable, new_stream = push_tail(id, s, band, tenant)
        newly, new_streams = newly + claimable, new_streams + new_stream
      end
    end
    end
    added = added + 1
    out[i + 1] = id
    -- no 'queued' message: the submitter has this reply, and nobody else knows the id
    end
  end
end
if #free_ids > 0 then
  local was = nil  -- the free list's length before the first push
  for j = 1, #free_ids, 4000 do
    local last = math.min(j + 3999, #free_ids)
    local len = redis.call('RPUSH', K_FREE, unpack(free_ids, j, last))
    if not was then was = len - (last - j + 1) end
  end
  if was == 0 then newly = newly + lane_mark('s', '') end  -- it became claimable
end
if deadlines then
  if redis.call('HGET', K_STATS, 'dl') ~= '1' then redis.call('HSET', K_STATS, 'dl', '1') end
  for j = 1, #deadlines, 4000 do
    redis.call('ZADD', K_SCHED .. 'deadlines', unpack(deadlines, j, math.min(j + 3999, #deadlines)))
  end
end
if hits > 0 then
  redis.call('HINCRBY', K_STATS, 'submitted', hits)
  redis.call('HINCRBY', K_STATS, 'succeeded', hits)
  redis.call('HINCRBY', K_STATS, 'cache_hits', hits)
  event('succeeded', now, {ids = cached_ids, cached = true})
end
if misses > 0 then
  redis.call('HINCRBY', K_STATS, 'cache_misses', misses)
  -- the index bounds the entries: expired ones leave it, the soonest to expire go past
  -- the most (their tasks keep their results for their own retention)
  redis.call('ZREMRANGEBYSCORE', K_CACHEX, '-inf', now)
  redis.call('ZADD', K_CACHEX, unpack(indexed))
  local over = redis.call('ZCARD', K_CACHEX) - cache_max
  if over > 0 then
    local popped = redis.call('ZPOPMIN', K_CACHEX, over)
    local gone = {}
    for j = 1, #popped, 2 do
      gone[#gone + 1] = K_CACHE .. popped[j]
      if #gone == 1000 then redis.call('DEL', unpack(gone)); gone = {} end
    end
    if #gone > 0 then redis.call('DEL', unpack(gone)) end
  end
end
if joined > 0 then redis.call('HINCRBY', K_STATS, 'cache_joined', joined) end
if handed > 0 then
  add_leases(leases)
  local ended = {}
  for _, w in ipairs(idle) do
    if #w[5] > 0 then
      -- its claim reply, as claim.lua's tasks part (its lease is the one it registered).
      -- The registration stays as it is while the worker comes back for every reply
      -- and no call hands it its whole room (what its slot could take); a reply it has
      -- not popped yet (it did not come back to its BLPOP: it died, or is frozen or
      -- busy) ends it: no more for it until it claims again
      local unread = redis.call('RPUSH', K_IDLE .. ':' .. w[1], cmsgpack.pack(w[4])) > 1
      if unread or w[3] == 0 then ended[#ended + 1] = w[1] end
      event('started', now, {ids = w[5], worker = w[1]})
    end
  end
  if #ended > 0 then redis.call('HDEL', K_IDLE, unpack(ended)) end
end
if #due > 0 then
  -- earlier than the set's first entry: a sleeper's timer is too long, wake one
  local first = redis.call('ZRANGE', K_DELAYED, 0, 0, 'WITHSCORES')
  local earliest = due[1]
  for j = 3, #due, 2 do earliest = math.min(earliest, due[j]) end
  for j = 1, #due, 4000 do
    redis.call('ZADD', K_DELAYED, unpack(due, j, math.min(j + 3999, #due)))
  end
  if not first[2] or earliest < tonumber(first[2]) then nudge() end
end
if added > 0 then
  local queued = added - handed - #due / 2
  if queued > 0 then redis.call('HINCRBY', K_STATS, 'waiting', queued) end
  redis.call('HINCRBY', K_STATS, 'submitted', added)
  if new_streams > 0 then redis.call('HINCRBY', K_STATS, 'streams', new_streams) end
  wake(newly, cap)
  event('queued', now, {n = added})
end
flush_replies()
return {handed, out}
