--[[ claim.lua -- reap, promote due retries, then claim up to B tasks.
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] worker id   ARGV[4] B (0 = only reap and promote)   ARGV[5] lease ms
ARGV[6] max deliveries   ARGV[7] reap/promote limit per call
ARGV[8] retention s   ARGV[9] dead-letter retention s   ARGV[10] dead-letter max length
ARGV[11] registration window ms: a claim that leaves the worker room (it took all there
  was, fewer than B) registers it in K_IDLE for this long, with that room, so that a
  submit may hand it tasks (0 = never; see "Direct delivery" in _lib.lua)
ARGV[12] '1' if the worker may be registered still (a claim registered it, and no
  claim since): its inbox is collected first (tasks handed to it meanwhile: nothing
  more is claimed then), and a claim that fills the batch or finds an inbox drops the
  registration
ARGV[13] the most one submit may hand the worker if this claim registers it (its room is
  the lesser of this and what it left of B; absent, as from an older worker: B): a
  worker that claims many small batches at once registers with the room of one
ARGV[14] the tenants' weights, "tenant=weight,..." (scheduling; unknown tenants: 1)
ARGV[15] the share of claimed cost a lower band with waiting work is owed, percent
  (0: strict priority)
ARGV[16], ARGV[17] the tenants' rate limits, requests and cost per minute,
  "tenant=N,...,*=N" (see _lib.lua)   ARGV[18] 'hold' to hold tasks over a limit
Returns: {next_timer_ms, reaped, inbox, scheduling (1: the queue schedules; see
  _lib.lua), then 9 entries per claimed task:
  id, lease token, payload, stream ('' = none), attempts, deliveries, retries ('' = default),
  age ms (time since it was submitted, server clock; the dynamic batcher's deadline),
  traceparent (W3C trace context stored by submit, '' = none; see mtq.tracing), with
  '|' and its run timeout in ms after it when the task has one (submit's timeout: the
  entry a task carries only when given, so the reply keeps its shape for older workers)}
  inbox is the list of claim replies handed to the worker (see submit.lua), each a
  msgpack array of 9 entries per task as above; empty unless ARGV[12] is '1'.
  next_timer_ms is the time until the earliest lease deadline, due retry, deadline of
  a waiting task, or (rate limits held) the time a held tenant may go on (-1: none);
  a worker that claimed nothing blocks on the wake list for at most that long.
Order: streams are taken round robin from the ring, one task each (the head of
the stream, which becomes busy); the stream-less marker gives one task per turn;
capacity left after the ring is empty is filled from the stream-less list.
A task whose deadline has passed is marked expired and skipped, never run; one that
waits behind others is found by its deadline (K_SCHED .. 'deadlines') and ends expired
where it waits.
With scheduling on (see _lib.lua), each task is taken from a lane: the highest band
with work, unless a lower band with work has a credit above 0 (it gains the
share's part of every cost the bands above it are served while it waits, and pays its
own tasks' costs); in that band, the tenant of least virtual time (among the band's
first PICK_K by it, read once, then kept here as this claim charges them), or, when
waiting tasks have deadlines, the one whose next task has the earliest deadline among
those within one task's cost of it; in that tenant's lane, its ring in turn, as above. Each task taken charges its tenant its cost
over its weight.
]]
--@include _lib.lua
local worker, B, lease = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local max_deliveries, limit = tonumber(ARGV[6]), tonumber(ARGV[7])
local ttl, dead_ttl, dead_max = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local window, registered = tonumber(ARGV[11]), ARGV[12] == '1'
local most = tonumber(ARGV[13] or '') or B
local share = tonumber(ARGV[15] or '0') or 0
local hold = ARGV[18] == 'hold'
local now = now_ms()
-- scheduling on? waiting tasks with deadlines? (one read)
local st0 = redis.call('HMGET', K_STATS, 'sched', 'dl')
SCHED_ON = st0[1] == '1'
local dl = st0[2] == '1'
-- handed to it since it last came back to its inbox: those are its batch (nothing more
-- is claimed now; its registration is dropped below)
local inbox = {}
if registered then
  local ik = K_IDLE .. ':' .. worker
  inbox = redis.call('LRANGE', ik, 0, -1)
  if #inbox > 0 then
    redis.call('DEL', ik)
    B = 0
  end
end
-- The earliest lease deadline and retry, read once: the reaper and the promoter run only
-- when one is due, and the timer this call returns is worked out from them (a list read
-- again only if the reaper or the promoter changed it).
local first_lease = redis.call('ZRANGE', K_LEASES, 0, 0, 'WITHSCORES')
local first_retry = redis.call('ZRANGE', K_DELAYED, 0, 0, 'WITHSCORES')
local reaped = 0
if due_in(first_lease, now) == 0 then
  reaped = reap_expired(now, limit, max_deliveries, ttl, dead_ttl, dead_max)
  first_lease = false
end
local promoted = 0  -- streams or free lists a due delayed submit made claimable
if due_in(first_retry, now) == 0 then
  promoted = select(2, promote_due(now, limit))
  first_retry = false
end
local first_deadline = nil
if dl then
  first_deadline = redis.call('ZRANGE', K_SCHED .. 'deadlines', 0, 0, 'WITHSCORES')
  if due_in(first_deadline, now) == 0 then
    sch().expire_due(now, limit, finish, event)
    first_deadline = redis.call('ZRANGE', K_SCHED .. 'deadlines', 0, 0, 'WITHSCORES')
  end
  if not first_deadline[1] then redis.call('HSET', K_STATS, 'dl', '0') end
end
local dl_done = nil  -- ids taken here that had a deadline: out of K_SCHED .. 'deadlines'

local out = {0, reaped, inbox, 0}
local n, taken, base = 0, 0, false
local until_ms = now + lease
local claimed, expired = {}, {}
-- every task claimed here gets its lease in one command (see add_leases)
local leases, nl = {'+inf', LEASE_MARK}, 2
-- what the ring and the free list were left as (each known empty saves a read at the end)
local ring_empty, free_empty = false, false

local weights = nil  -- scheduling: tenant -> weight (weights_of)
local PICK = nil     -- scheduling: band -> what this call read of its tenants (see load)
-- scheduling: the run being taken (see run_lane): its lane's counts' changes, and the
-- charge its tasks store ("weight|band|tenant": see _lib.lua, Scheduling)
local RUN = nil

-- Claim one popped id. Returns true if it now runs (with scheduling on: its cost);
-- false for a tombstone, an expired task, or (lb, lt: the lane it was popped from,
-- scheduling on) the head of a stream of another lane, which moves the stream there.
local function take(id, s, lb, lt)
  local tk = K_TASK .. id
  local f
  if lb then
    f = redis.call('HMGET', tk, 'status', 'payload', 'deadline', 'deliveries', 'attempts', 'retries',
      'created', 'reply', 'traceparent', 'trace', 'timeout', 'band', 'tenant', 'cost')
  else
    f = redis.call('HMGET', tk, 'status', 'payload', 'deadline', 'deliveries', 'attempts', 'retries',
      'created', 'reply', 'traceparent', 'trace', 'timeout')
  end
  if f[1] ~= 'queued' then
    -- a cancelled or expired tombstone: its retention starts now that it left the list
    if f[1] == 'cancelled' or f[1] == 'expired' then
      redis.call('EXPIRE', tk, ttl)
      if f[10] ~= '0' then redis.call('EXPIRE', K_TRACE .. id, ttl) end
    end
    return false
  end
  local cost, weight, tb, tt = true, nil, nil, nil
  if lb then
    tb, tt = f[12] or 's', f[13] or ''
    if s and (tb ~= lb or tt ~= lt) then
      -- its stream is in the ring of another lane (a task of an older producer or
      -- worker put it in K_READY, or a tombstone was its head): move it to its own
      redis.call('LPUSH', K_STREAM .. s, id)
      ring_push(s, false, tb, tt)
      -- (ring_push leaves the lane ('s', '') to the start of a claim: this one is past it)
      if tb == 's' and tt == '' then SCH.activate('s', '') end
      PICK[tb] = nil  -- its tenant may be new to the band: read it again
      return false
    end
    cost = tonumber(f[14] or '1')
    weight = RUN.charge
  end
  taken = taken + 1
  if f[3] and dl then
    dl_done = dl_done or {}
    dl_done[#dl_done + 1] = id
  end
  if f[3] and tonumber(f[3]) < now then
    finish(id, 'expired', now, ttl)
    expired[#expired + 1] = id
    if lb then RUN.w, RUN.c = RUN.w - 1, RUN.c - cost end
    return false
  end
  if lb then RUN.w, RUN.c, RUN.r = RUN.w - 1, RUN.c - cost, RUN.r + 1 end
  n = n + 1
  if not base then base = redis.call('INCRBY', K_SEQ, B) - B end  -- B tokens, for this call
  local token = tostring(base + n)
  local deliveries = tonumber(f[4] or '0') + 1
  if weight then
    redis.call('HSET', tk, 'status', 'running', 'worker', worker, 'token', token,
      'started', num(now), 'deliveries', f[4] and num(deliveries) or '1', 'weight', weight)
  else
    redis.call('HSET', tk, 'status', 'running', 'worker', worker, 'token', token,
      'started', num(now), 'deliveries', f[4] and num(deliveries) or '1')
  end
  leases[nl + 1] = num(until_ms)
  leases[nl + 2] = id
  nl = nl + 2
  if f[10] ~= '0' then  -- its trace is stored (see _lib.lua)
    redis.call('RPUSH', K_TRACE .. id, trace_line(now, 'started', 'delivery ' .. deliveries .. ' on ' .. worker))
  end
  local o = 4 + 9 * (n - 1)  -- (#out, without its search)
  out[o + 1] = id; out[o + 2] = token; out[o + 3] = f[2]; out[o + 4] = s or ''
  out[o + 5] = f[5] or '0'; out[o + 6] = deliveries; out[o + 7] = f[6] or ''
  out[o + 8] = math.max(0, now - tonumber(f[7] or now))
  out[o + 9] = f[11] and (f[9] or '') .. '|' .. f[11] or f[9] or ''
  claimed[n] = id
  reply('started', f[8], id, deliveries)
  return cost
end

local sched = sched_on()
local held_for = -1  -- ms until the first held tenant may go on (-1: none held)
if sched and B > 0 then  -- (B = 0: only reap and promote, or the inbox was the batch)
  -- Scheduling on: claim from the lanes (see the header and _lib.lua).
  local S = sch()
  local BANDS, lane_ring, lane_free, activate = S.BANDS, S.lane_ring, S.lane_free, S.activate
  local rate_wait, rate_charge = S.rate_wait, S.rate_charge
  local PICK_K = 16
  local VT, DIRTY, SERVED = {}, {}, {}
  PICK = {}
  -- the virtual times this call changed, into the hash and the bands' sets (one
  -- command each, whatever the number of tenants)
  local function flush_vt()
    local h, z = {}, {}
    for t in pairs(DIRTY) do
      h[#h + 1] = t
      h[#h + 1] = VT[t]
      z[#z + 1] = VT[t]
      z[#z + 1] = t
    end
    if #h == 0 then return end
    redis.call('HSET', K_SCHED .. 'vt', unpack(h))
    for _, b in ipairs(BANDS) do redis.call('ZADD', K_SCHED .. 'band:' .. b, 'XX', unpack(z)) end
    DIRTY = {}
  end
  -- the band's first PICK_K tenants by virtual time, and the time of the next (the bound
  -- under which the least of those is the band's least)
  local HELD, nheld = {}, 0  -- tenants this claim passes over for their rate limits
  local function read(b)
    local r = redis.call('ZRANGE', K_SCHED .. 'band:' .. b, 0, PICK_K + nheld, 'WITHSCORES')
    local list, bound = {}, math.huge
    for j = 1, #r, 2 do
      if not HELD[r[j]] then
        if #list == PICK_K then
          bound = tonumber(r[j + 1])
          break
        end
        list[#list + 1] = r[j]
      end
    end
    return list, bound
  end
  local function load(b)
    local list, bound = read(b)
    if bound < math.huge and next(DIRTY) then
      -- more than it reads: which are the least depends on the times this call changed
      flush_vt()
      list, bound = read(b)
    end
    local unknown = {}
    for _, t in ipairs(list) do
      if VT[t] == nil then unknown[#unknown + 1] = t end
    end
    if #unknown > 0 then
      -- their times from the hash, which a hand-off to a sleeping worker moved on
      -- alone (the set's order may lag behind it)
      local v = redis.call('HMGET', K_SCHED .. 'vt', unpack(unknown))
      for i, t in ipairs(unknown) do VT[t] = tonumber(v[i] or '0') end
    end
    PICK[b] = {list, bound}
    return PICK[b]
  end
  -- the tenant of band b with the least virtual time, and its place in the list; nil: none
  -- (read once more at most: a bound the set's order holds below the hash's times, which
  -- hand-offs move alone, is not read again and again)
  local function pick(b)
    local p, again = PICK[b] or load(b), true
    while true do
      local best, at = nil, 0
      for i, t in ipairs(p[1]) do
        if not best or VT[t] < VT[best] then best, at = t, i end
      end
      if best and (VT[best] <= p[2] or not again) then return best, at end
      if not best and (p[2] == math.huge or not again) then return nil end
      p, again = load(b), false
    end
  end
  -- the deadline (math.huge: none) and cost of the task lane (b, t) would run next, as far
  -- as its ring's head says (nil: nothing in the ring)
  local function peek(b, t)
    local s = redis.call('LINDEX', lane_ring(b, t), 0)
    if not s then return nil end
    local id = redis.call('LINDEX', s == FREE and lane_free(b, t) or K_STREAM .. s, 0)
    if not id then return math.huge, 1 end
    local f = redis.call('HMGET', K_TASK .. id, 'deadline', 'cost')
    return tonumber(f[1] or '') or math.huge, tonumber(f[2] or '1')
  end
  -- Earlier deadlines first where the fair share allows: among the band's tenants whose
  -- virtual time is within the cost (over its weight) of the next task of the least one,
  -- the one whose next task has the earliest deadline (at most EDF_K looked at).
  local EDF_K = 4
  local function earliest(b, t, at)
    local d0, c0 = peek(b, t)
    if not d0 then return t, at end
    local within, best, looked = VT[t] + c0 / (weights[t] or 1), d0, 0
    for i, x in ipairs(PICK[b][1]) do
      if x ~= t and VT[x] <= within and looked < EDF_K then
        looked = looked + 1
        local d = peek(b, x)
        if d and d < best then best, t, at = d, x, i end
      end
    end
    return t, at
  end
  weights = S.weights_of(ARGV[14])
  local rpm, tpm = S.limits_of(ARGV[16]), S.limits_of(ARGV[17])
  hold = hold and (next(rpm) ~= nil or next(tpm) ~= nil)
  -- an older producer's or worker's tasks reach K_READY alone: that lane is a candidate
  if redis.call('LLEN', K_READY) > 0 then activate('s', '') end
  local st = redis.call('HMGET', K_SCHED .. 'vt', '~V', '~s', '~b', '~m0', '~mc', '~mb', '~rate')
  -- a band's credit: nil when it had no work waiting behind a higher band ('' stored)
  local clock, credit = tonumber(st[1] or '0'), {s = tonumber(st[2] or ''), b = tonumber(st[3] or '')}
  local ratio = (share > 0 and share < 100) and share / (100 - share) or 0
  local claimed_cost = 0

  -- the lower band with work whose credit is above 0 (the highest such), or nil
  local function owed(top)
    if ratio == 0 then return nil end
    for _, b in ipairs(BANDS) do
      if b ~= 'i' and b ~= top and (top == 'i' or b == 'b') and (credit[b] or 0) > 0
          and pick(b) then
        return b
      end
    end
    return nil
  end

  -- A run: the tasks one pick of tenant t takes. Charge a task of cost c taken in band
  -- `band` while `top` was the highest band with work (its lane's served cost: l); say
  -- whether the run goes on: room left, t's virtual time at most the run's limit, t's
  -- rate limit allowing (a lower band that becomes owed waits for the next pick).
  local run = {limit = 0, base = 0, tasks = 1, first = true, s = false, b = false}
  -- lane -> the stream-less ids this call popped of it ({ids, at: the next, more: the list
  -- may hold more, fl: the list}); those not taken go back at its head at the end
  local FREE_BUF = {}
  RUN = {w = 0, c = 0, r = 0, charge = ''}
  local NCAND = {}  -- band -> its candidates, when more than PICK_K (read once)
  local function charge(band, top, t, l, c)
    local w = run.w
    if run.first then
      -- a run may pass the next tenant's virtual time by its share of the claim's room
      -- (in tasks of its first's cost), so that a batch is taken in a few runs, not one
      -- pick per task; it costs the fair share that much more lag (docs/scheduling.md)
      run.first, run.c1 = false, c
      run.limit = run.base + run.tasks * c / w
    end
    VT[t] = VT[t] + c / w
    run.cost = run.cost + c
    if hold then rate_charge(t, 1, c, now, rpm, tpm) end
    if band ~= top then return false end  -- a task a lower band was owed: then choose again
    -- (its next task taken to cost what this one did)
    return n < B and VT[t] + c / w <= run.limit
      and not (hold and rate_wait(t, 1, now, rpm, tpm) > 0)
  end
  -- what a run cost: the tenant's served cost, and the bands' credits
  local function charged(band, top, t, l)
    local c = run.cost
    if c == 0 and run.first then return end  -- it took nothing
    claimed_cost = claimed_cost + c
    DIRTY[t] = true
    SERVED[l] = (SERVED[l] or 0) + c
    if band ~= top then
      credit[band] = credit[band] - c
    elseif ratio > 0 then
      credit[top] = nil  -- served as the top band: it waits behind nobody
      for _, b in ipairs(BANDS) do
        if b ~= 'i' and b ~= top and (top == 'i' or b == 'b') then
          if not run[b] then  -- (has it work? read at the run's start)
            credit[b] = nil  -- no work: it starts afresh when work comes
          else
            -- a band that starts waiting owes a task of the run's first's cost first, so
            -- that it is served once in every 1 + 1 / ratio tasks of like cost
            if credit[b] == nil then credit[b] = -run.c1 end
            credit[b] = credit[b] + c * ratio  -- (owed from the next pick on)
          end
        end
      end
    end
  end

  -- Tenant t's run in its lane (band): its ring in turn, one task of each stream or a
  -- burst of its stream-less tasks, while charge() says it goes on. Returns whether the
  -- lane's ring ran out (nothing claimable: the tenant leaves the band's candidates).
  local function run_ring(band, top, t, ring, l)
    while true do
      local s = redis.call('LPOP', ring)
      if not s then return true end
      local more = true
      if s == FREE then
        -- a burst of its stream-less tasks, from what this call popped of them (as many
        -- as the run may take, an owed band's one; what is left goes back at the end:
        -- see FREE_BUF)
        local buf = FREE_BUF[l]
        while true do
          if not buf or (buf.at > #buf.ids and buf.more and n < B) then
            local fl = lane_free(band, t)
            local want = band == top and math.min(B - n, run.tasks) or 1
            local ids = redis.call('LPOP', fl, want) or {}
            buf = {ids = ids, at = 1, more = #ids == want, fl = fl}
            FREE_BUF[l] = buf
          end
          if buf.at > #buf.ids then break end
          local c = take(buf.ids[buf.at], false, band, t)
          buf.at = buf.at + 1
          if c then
            more = charge(band, top, t, l, c)
            if not more then break end
          end
        end
        if buf.at <= #buf.ids or buf.more then
          redis.call('RPUSH', ring, FREE)  -- its next burst at its next turn
        elseif band == 's' and t == '' then
          redis.call('HSET', K_STATS, 'free_marked', '0')
        else
          redis.call('HDEL', K_SCHED .. 'marked', l)
        end
      elseif redis.call('SISMEMBER', K_BUSY, s) == 0 then
        local sk, popped, c = K_STREAM .. s, false, false
        while not c do
          local id = redis.call('LPOP', sk)
          if not id then break end
          popped = true
          c = take(id, s, band, t)
          if c == false and redis.call('LINDEX', sk, 0) == id then break end  -- moved
        end
        if popped and redis.call('LLEN', sk) == 0 then redis.call('HINCRBY', K_STATS, 'streams', -1) end
        if c then
          redis.call('SADD', K_BUSY, s)
          more = charge(band, top, t, l, c)
        end
      end
      if not more then return false end
    end
  end
  -- (the run's lane counts and charge, then run_ring)
  local function run_lane(band, top, t)
    local ring, l = lane_ring(band, t), band .. ':' .. t
    RUN.w, RUN.c, RUN.r = 0, 0, 0
    run.w = weights[t] or 1
    RUN.charge = num(run.w) .. '|' .. band .. '|' .. t
    run.s, run.b = top == 'i' and pick('s') ~= nil, top ~= 'b' and pick('b') ~= nil
    run.cost = 0
    local out = run_ring(band, top, t, ring, l)
    charged(band, top, t, l)
    S.lane_count(band, t, RUN.w, RUN.c, RUN.r)
    return out
  end

  while n < B do
    local top = nil
    for _, b in ipairs(BANDS) do
      if pick(b) then top = b; break end
    end
    if not top then ring_empty = true; free_empty = true; break end
    local band = owed(top) or top
    local t, at = pick(band)
    if dl then t, at = earliest(band, t, at) end
    local p = PICK[band]
    local wait = hold and rate_wait(t, 1, now, rpm, tpm) or 0
    if wait > 0 then
      -- over its rate limit: passed over until it may go on (the timer says when)
      HELD[t] = true
      nheld = nheld + 1
      if held_for < 0 or wait < held_for then held_for = wait end
      redis.call('HINCRBY', K_SCHED .. 'count', band .. ':' .. t .. '|h', 1)
      for _, b in ipairs(BANDS) do
        local q = PICK[b]
        if q then
          for i, x in ipairs(q[1]) do
            if x == t then table.remove(q[1], i); break end
          end
        end
      end
    else
      if VT[t] > clock then clock = VT[t] end
      -- the run's base: the next tenant's virtual time (or the bound of those not read)
      run.base, run.first = p[2], true
      for _, x in ipairs(p[1]) do
        if x ~= t and VT[x] < run.base then run.base = VT[x] end
      end
      -- its share of the room: by the band's candidates (all of them, when more than
      -- were read)
      local cands = #p[1]
      if p[2] < math.huge then
        NCAND[band] = NCAND[band] or redis.call('ZCARD', K_SCHED .. 'band:' .. band)
        cands = NCAND[band]
      end
      run.tasks = math.ceil((B - n) / math.max(1, cands))
      if run_lane(band, top, t) then
        -- its lane has nothing claimable: not a candidate until work comes back
        S.leave(band, t)
        if PICK[band] == p then table.remove(p[1], at) end  -- (else read again)
      end
    end
  end
  for _, buf in pairs(FREE_BUF) do
    if buf.at <= #buf.ids then
      local back = {}
      for x = #buf.ids, buf.at, -1 do back[#back + 1] = buf.ids[x] end
      redis.call('LPUSH', buf.fl, unpack(back))
    end
  end
  flush_vt()
  S.add_fields(K_SCHED .. 'served', SERVED)
  if n >= B then
    ring_empty = not (pick('i') or pick('s') or pick('b'))
    free_empty = true
  end
  -- the service rate (cost per second), measured over windows of METER_MS in which a
  -- claim left work waiting (an idle queue's rate says nothing of what it can serve)
  local m0, mc, mb, rate = tonumber(st[4] or '0'), tonumber(st[5] or '0'), st[6] == '1', tonumber(st[7] or '0')
  local METER_MS = 2000
  mc = mc + claimed_cost
  mb = mb or not ring_empty
  if now - m0 >= METER_MS then
    if mb and m0 > 0 then
      local r = mc * 1000 / (now - m0)
      rate = rate > 0 and 0.5 * rate + 0.5 * r or r
    end
    m0, mc, mb = now, 0, false
  end
  redis.call('HSET', K_SCHED .. 'vt', '~V', clock, '~s', credit.s or '', '~b', credit.b or '',
    '~m0', m0, '~mc', mc, '~mb', mb and '1' or '0', '~rate', rate)
end

while not sched and n < B do
  local s = redis.call('LPOP', K_READY)
  if not s then ring_empty = true; break end
  if s == FREE then
    redis.call('HSET', K_STATS, 'free_marked', '0')
    while true do
      local id = redis.call('LPOP', K_FREE)
      if not id or take(id, false) then break end
    end
  elseif redis.call('SISMEMBER', K_BUSY, s) == 0 then
    local sk, popped = K_STREAM .. s, false
    while true do
      local id = redis.call('LPOP', sk)
      if not id then break end
      popped = true
      if take(id, s) then
        redis.call('SADD', K_BUSY, s)
        break
      end
    end
    if popped and redis.call('LLEN', sk) == 0 then redis.call('HINCRBY', K_STATS, 'streams', -1) end
  end
end
-- Tombstones (cancelled, expired) do not count: keep popping until full or empty.
while not sched and n < B do
  local ids = redis.call('LPOP', K_FREE, B - n)
  if not ids then free_empty = true; break end
  for _, id in ipairs(ids) do take(id, false) end
end
if #leases > 2 then add_leases(leases) end
local marked = 0
if not free_empty and redis.call('LLEN', K_FREE) > 0 then marked = free_mark() end
if taken > 0 then redis.call('HINCRBY', K_STATS, 'waiting', -taken) end
if #expired > 0 then
  redis.call('HINCRBY', K_STATS, 'expired', #expired)
  event('expired', now, {ids = expired})
end
if n > 0 then event('started', now, {ids = claimed, worker = worker}) end
-- it took all there was and has room left: a submit may hand it tasks from now on (see
-- _lib.lua; a worker that was busy when the queue emptied becomes one to hand to here)
local room = math.min(B - n, most)
if room > 0 and window > 0 then
  -- '|s': the queue schedules (a submit that hands it a task charges it, see submit.lua)
  redis.call('HSET', K_IDLE, worker, num(now + window) .. '|' .. num(lease) .. '|' .. num(room)
    .. (sched and '|s' or ''))
elseif registered then
  redis.call('HDEL', K_IDLE, worker)
end
-- Work left over: wake one more worker to help (it will chain on if still more).
-- No work left: drop stale markers so sleepers do not wake for nothing.
if marked == 1 or (not ring_empty and ((sched and (B > 0 or promoted > 0)) or redis.call('LLEN', K_READY) > 0)) then
  nudge()
else
  redis.call('DEL', K_WAKE)
end
-- from the reads above (a list the reaper or the promoter changed is read again); a
-- lease taken here ends at until_ms
if dl_done then redis.call('ZREM', K_SCHED .. 'deadlines', unpack(dl_done)) end
local nxt = next_timer(now, {[K_LEASES] = first_lease, [K_DELAYED] = first_retry})
if n > 0 and (nxt < 0 or lease < nxt) then nxt = lease end
for _, d in ipairs({first_deadline and due_in(first_deadline, now) or -1, held_for}) do
  if d >= 0 and (nxt < 0 or d < nxt) then nxt = d end
end
out[1] = nxt
if sched then out[4] = 1 end
flush_replies()
return out
