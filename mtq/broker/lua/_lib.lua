--[[ _lib.lua -- shared by every mtq script (pasted in by the loader at "--@include _lib.lua").

KEYS, identical for every script of a queue (mtq/broker/keys.py builds them; all carry
the hash tag {queue}, so every script touches one Redis Cluster slot; admit.lua, of an
API key and no queue, takes that key's own rate hash instead):
  KEYS[1]  task key prefix    mtq:{q}:task:      (+ id  -> hash)
  KEYS[2]  stream key prefix  mtq:{q}:stream:    (+ name -> list of waiting ids, FIFO)
  KEYS[3]  ready              list: the round-robin ring of claimable streams ('' = stream-less tasks)
  KEYS[4]  busy               set: streams with a task running or waiting to be retried
                              (not one submitted with a delay: it holds nothing up), or
                              held until a chain step's hand-off is complete (K_HELD)
  KEYS[5]  leases             zset: running id -> lease deadline (ms, server time), and
                              LEASE_MARK -> +inf (see below)
  KEYS[6]  delayed            zset: id waiting for a retry, or submitted with a delay
                              ('due' in its hash), -> due time (ms)
  KEYS[7]  dead               list: dead-letter ids, newest first
  KEYS[8]  wake               list: markers sleeping workers BLPOP on
  KEYS[9]  stats              hash: O(1) counters
  KEYS[10] free               list: waiting stream-less ids, FIFO
  KEYS[11] idempotency prefix mtq:{q}:idem:      (+ key -> task id, expires)
  KEYS[12] seq                string: lease token counter
  KEYS[13] output prefix      mtq:{q}:out:       (+ id  -> list of streamed tokens, by index)
  KEYS[14] trace prefix       mtq:{q}:trace:     (+ id  -> list of "ms|kind|detail", the
                                                  task's life: queued, started, retry,
                                                  restarted, released, cancel requested, <terminal
                                                  status>; expires with the task. Written only
                                                  for a task that left the happy path: see
                                                  "Trace" below)
  KEYS[15] latency            list: submit-to-finish ms of the last LATENCY_KEEP finished
                              tasks, newest first (dashboards: p50/p99 in O(1) of the queue;
                              up to LATENCY_SLACK older ones may follow: read the first
                              LATENCY_KEEP); expires (see DIAG_TTL_MS)
  KEYS[16] failures           list: JSON {id, status, ts, error} of the last FAILURES_KEEP
                              tasks that ended failed, dead or expired, newest first;
                              expires (see DIAG_TTL_MS)
  KEYS[17] cache prefix       mtq:{q}:cache:     (+ model version .. ':' .. payload digest
                                                  -> a cached result; see submit.lua)
  KEYS[18] cache index        zset: cache entry key -> expiry (ms), bounds the entries
  KEYS[19] model              hash: the model the queue's workers serve (target, version,
                              deterministic, loaded)
  KEYS[20] idle               hash: worker id -> "expiry ms|lease ms|room[|s]" of each worker
                              asleep with room for tasks (claim.lua registers it; room:
                              the most one submit hands it);
                              K_IDLE .. ':' .. worker id is its inbox, a list of claim
                              replies a submit handed to it (see "Direct delivery")
  KEYS[21] scheduling prefix  mtq:{q}:sched:     (+ the keys of "Scheduling" below)
  KEYS[22] handoffs           zset: id of a succeeded task of a chain whose next step is
                              still to be submitted -> when it succeeded (ms); written by
                              ack.lua, emptied by the worker that submits the next step
                              (mtq/broker/chains.py) through handed.lua;
                              K_HANDOFFS .. ':streams' (K_HELD), hash: id -> the stream of
                              such a task, which stays busy (held, as if the task still
                              ran) until handed.lua removes the record and releases it
ARGV[1] events channel (dashboards, JSON), ARGV[2] control channel (workers, JSON);
the rest is per script.

Reply channels: a task's hash names the channel of the client that submitted it
('reply'; clients that wait on a task they did not submit add theirs, space
separated, see watch.lua). Scripts queue what they tell clients with reply() and publish it with
flush_replies() at the end, one message per (kind, channel) however many tasks it
concerns, so a claim of 64 tasks of one client costs one PUBLISH. A message is
msgpack: {kind, server time in us, items}, items flat per task:
  queued    id                              (a release or a dead letter retried: back in the queue unrun;
                                             a submit sends none)
  started   id, delivery                    (claim)
  token     id, index, data                 (emit; data is the msgpack-encoded token)
  progress  id, data                        (emit)
  restarted id, delivery, reason            (its worker died, or a retry was scheduled:
                                             the stream goes on where it stopped)
  done      id, status, value               (finish: the result when succeeded and at most
                                             REPLY_INLINE bytes, false when larger (read
                                             the task); the error otherwise)
The result is written to the task before the message is queued, so a client that
missed the message reads it from the task.

Prefix keys are where Lua appends to a key name: ids are only known inside the
script (claim pops them); besides them, a worker's inbox (K_IDLE .. ':' .. worker) and
K_HELD (K_HANDOFFS .. ':streams'). The hash tag sits in the prefix, so the result
always hashes to the queue's slot.

Trace: a task on the happy path (queued, started once, ended) has no trace list: its
lines are read from its own fields (created, started, deliveries, worker, finished,
status, error; trace_lines() below), which costs no command per task. Its 'trace'
field is '0' (set by submit). The first time anything else happens to it (a retry, a
restart, a release, a cancel request, a retry from the dead letters), materialize()
writes the lines so far into the list and sets 'trace' to '1'; from then on every
line is stored (claim and finish() add theirs). A task without the field was made
by an older mtq and has a complete list. trace.lua reads either kind.
Likewise 'out' = '1' marks a task that streamed tokens (emit.lua), so that finish()
expires its token list only if there is one.

Fencing: ack, nack and extend act only on a task whose status is 'running' AND
whose token matches, so a token left in the hash after the task moves on is inert
(retry and release leave it for the next claim to overwrite).

Direct delivery: a worker whose claim took all there was and left it room is registered
in K_IDLE (with its lease and that room, or less: the most it names, one batch of a
claim of many) until it claims again, for at most a window it names (under half a
lease). A submit that finds one hands it the new tasks that would
have been claimable at once (a stream-less task while the free list is empty, or the
head of an empty stream that is not busy): it writes them as claim.lua would have left
them (running, leased, under a token), up to the worker's room (the most one submit hands
it: a burst spreads over the sleeping workers), and pushes one claim reply to the
worker's inbox. The registration stays as it is until its window ends, until a submit
hands the worker its whole room, until the worker takes it back (its batch slot is full),
or until a push finds the reply before it still unread (the worker died, or is frozen or busy: so a
worker killed while it slept takes at most two submits' tasks into its grave, and
their leases bring them back). The sleeping
worker's BLPOP returns that reply: one hop instead of a wake-up, a claim and its reply;
and it goes back to sleep on its inbox without a claim, for as many hand-offs as come
while it comes back for each. Everything else (retries,
releases, reclaims) is queued, and a sleeper woken for it with a wake marker. A worker
that stops or pauses takes its registration back.

Scheduling (docs/scheduling.md): a task may carry a band ('band': 'i' interactive or
'b' batch; absent: 's', standard), a tenant ('tenant'; absent: '', the tenant of
tasks that name none) and a cost ('cost'; absent: 1). A queue's first such task turns
its scheduling on (K_STATS 'sched' = '1', for good); until then every script runs
exactly as without it. With it on, waiting work is kept in lanes, one per (band,
tenant): each a ring of streams and a free list, as K_READY and K_FREE are for the
lane ('s', ''), which keeps those two keys (an older worker serves that lane alone).
A stream is in the ring of the lane of its head task: it competes in its head's band,
for its head's tenant (claim.lua moves a stream it finds in another lane's ring). Keys,
after K_SCHED:
  ready:<b>:<t>   list: the lane's ring (streams, and FREE when its free list is not empty)
  free:<b>:<t>    list: the lane's waiting stream-less ids
  band:<b>        zset: tenant -> its virtual time, for the tenants with work in band b
                  (may hold a tenant whose lane turned out empty: claim drops it)
  vt              hash: tenant -> virtual time: the cost served to it divided by its
                  weight, summed (what a claim goes by; a band's set holds it as its
                  order, which a task handed to a sleeping worker leaves behind); '~V' -> the virtual clock, the least virtual time a
                  claim picked (a tenant that comes back after an idle time starts there:
                  it banks no credit for the time it was away)
                  '~s', '~b' -> the credit of bands s and b against starvation (claim.lua;
                  '': the band had no work waiting behind a higher one at the last claim);
                  '~rate' -> the queue's measured service rate (cost per second, over
                  windows of METER_MS in which work was left waiting), '~m0', '~mc',
                  '~mb' -> the window being measured: its start, its claimed cost, whether
                  a claim in it left work waiting
  rate            hash: '<t>|r', '<t>|c' -> the tenant's rate limits' state (GCRA: the
                  theoretical arrival time, ms, of its next request and of its next cost)
  deadlines       zset: id of a waiting task that has a deadline -> the deadline (ms);
                  kept for every queue (K_STATS 'dl' = '1' once one was added): a claim
                  ends those due expired where they wait
  served          hash: '<b>:<t>' -> the cost served to the lane (charged at claim,
                  settled at the end with the cost the worker reports)
  count           hash: '<b>:<t>|w' -> waiting tasks of the lane, '|c' -> their cost,
                  '|r' -> its running tasks, '|h' -> how often a claim passed it over for
                  its rate limit (hold), '|x' -> tasks refused at submit (rate limit,
                  deadline); kept by every script that moves a task, with scheduling on
                  (at its turn on, the lane ('s', '') starts from the queue's counters)
  lanes           set: '<b>:<t>' of every lane that had work (purge and status read it)
  marked          hash: '<b>:<t>' -> '1' while FREE is in the lane's ring (FREE of the
                  lane ('s', '') is K_STATS 'free_marked', as before)
Rate limits (per tenant, requests and cost per minute, from the queue's settings): in
'reject' mode a submit over a limit is refused whole (E_RATE_LIMITED); in 'hold' mode
it is queued and a claim passes its tenant over until its limit allows (the claim's
timer says when). Deadline admission: a task submitted with a deadline to keep is
refused whole (E_WOULD_MISS) if the cost waiting ahead of it (higher bands, then its
band as the fair share would serve it) at the measured service rate would start it
after its deadline.
A claim charges each task it takes its cost over its tenant's weight (stored in the
task: 'weight' = "weight|band|tenant", what an ack needs to count it out); the task's worker may report the cost it really had when it settles
the task (ack, nack), and the difference is charged then. A task killed before it
settles keeps the charge of its claim.

Ring invariant (what makes ordering hold): a stream whose list is non-empty and
which is not in busy is in the ring. The ring may also hold stale or duplicate
entries; claim checks each popped stream (busy? list empty?) and drops those.
Cancelled and expired ids may remain in lists as tombstones; claim skips any id
whose status is not 'queued'.
]]
local K_TASK, K_STREAM, K_READY, K_BUSY = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_LEASES, K_DELAYED, K_DEAD, K_WAKE = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local K_STATS, K_FREE, K_IDEM, K_SEQ, K_OUT = KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13]
local K_TRACE, K_LATENCY, K_FAILURES = KEYS[14], KEYS[15], KEYS[16]
local K_CACHE, K_CACHEX, K_MODEL, K_IDLE = KEYS[17], KEYS[18], KEYS[19], KEYS[20]
local K_SCHED, K_HANDOFFS = KEYS[21], KEYS[22]
local K_HELD = K_HANDOFFS .. ':streams'
local LATENCY_KEEP, LATENCY_SLACK, FAILURES_KEEP = 1000, 200, 100
-- the expiry of a latency or failures list a script makes: diagnostics_ttl_s's default
-- (mtq/settings.py); the beats of the queue's workers set the queue's own
local DIAG_TTL_MS = 86400000
local EVENTS, CONTROL = ARGV[1], ARGV[2]
local FREE = ''
-- results up to this size ride in the done message; larger ones are read from the task
local REPLY_INLINE = 65536
-- 'SPUBLISH' in the variant of the scripts for a sharded cluster (mtq/broker/scripts.py):
-- every channel a script publishes to carries the queue's hash tag, so it is the shard's
local PUBLISH = 'PUBLISH'

-- A member of the leases set that is no task (ids are at most 64 of [A-Za-z0-9_-]),
-- scored +inf, and longer than Redis's zset-max-listpack-value (64 by default): it keeps
-- the set a skiplist, where adding or removing a lease is O(log n), not a scan of the
-- whole listpack (Redis's encoding for sets of up to 128 small members, which a worker
-- claiming a batch ahead fills, a scan on every ZADD and ZREM of a lease; its cost:
-- docs/architecture.md, Redis keys). claim adds it with each batch's leases; it is never
-- reaped (+inf), and every reader leaves it out (next_timer, orphans.lua; "running" is
-- ZCOUNT of the finite scores: mtq/broker/protocol.py, mtq/broker/scrape.py, mtq/trace.py).
local LEASE_MARK = '~ the lease index: keeps this set a skiplist (see _lib.lua), not a task'
LEASE_MARK = LEASE_MARK .. string.rep('.', 80 - #LEASE_MARK)

-- Add leases: leases = {'+inf', LEASE_MARK, deadline, id, deadline, id, ...}, the mark first
-- (the set is a skiplist before the leases go in), in one ZADD per 2,000 (Lua's unpack).
local function add_leases(leases)
  for i = 1, #leases, 4000 do
    redis.call('ZADD', K_LEASES, unpack(leases, i, math.min(i + 3999, #leases)))
  end
end

-- error codes (mtq/broker/codes.py mirrors them)
local E_QUEUE_FULL, E_DUPLICATE_ID, E_LEASE_LOST, E_NOT_FOUND, E_FINISHED, E_BAD_ARGUMENT,
  E_RATE_LIMITED, E_WOULD_MISS = -1, -2, -3, -4, -5, -6, -7, -8

local NOW_US = 0

-- A number as a command argument or in a string: formatted (sprintf "%.14g", costly
-- next to a command) once per script for each value. A script formats the same few
-- values (now, a deadline, a retention) for every task it touches.
local NUMSTR = {}
local function num(n)
  local s = NUMSTR[n]
  if not s then
    s = tostring(n)
    NUMSTR[n] = s
  end
  return s
end
local function now_ms()
  local t = redis.call('TIME')
  NOW_US = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- What this script tells clients, by kind then reply channel (see the header).
local REPLY_KINDS = {'queued', 'started', 'token', 'progress', 'restarted', 'done'}
local REPLIES = {}
local reply
function reply(kind, channel, a, b, c)
  if not channel or channel == '' then return end
  if string.find(channel, ' ', 1, true) then  -- watched by more than one client
    for ch in string.gmatch(channel, '%S+') do reply(kind, ch, a, b, c) end
    return
  end
  local by = REPLIES[kind]
  if not by then by = {}; REPLIES[kind] = by end
  local items = by[channel]
  if not items then items = {}; by[channel] = items end
  local n = #items
  items[n + 1] = a
  if b ~= nil then items[n + 2] = b end
  if c ~= nil then items[n + 3] = c end
end

-- One line of a task's trace (see KEYS[14]).
local function trace_line(now, kind, detail)
  return (type(now) == 'number' and num(now) or now) .. '|' .. kind .. '|' .. (detail or '')
end

-- The hash fields trace_lines() reads (see "Trace" in the header), 'trace' first.
local TRACE_FIELDS = {'trace', 'created', 'stream', 'started', 'deliveries', 'worker',
                      'finished', 'status', 'error', 'cached'}
local TERMINAL = {succeeded = true, failed = true, dead = true, cancelled = true, expired = true}

-- The trace of a task that has no list ('trace' = '0'), from f = HMGET TRACE_FIELDS.
local function trace_lines(f)
  if f[10] then  -- answered from the result cache at submit
    return {trace_line(f[2], 'cached', 'answered from the result cache'),
            trace_line(f[7], 'succeeded')}
  end
  local lines = {}
  if f[2] then lines[1] = trace_line(f[2], 'queued', f[3] and ('stream ' .. f[3]) or nil) end
  if f[4] then
    lines[#lines + 1] = trace_line(f[4], 'started', 'delivery ' .. (f[5] or '1') .. ' on ' .. (f[6] or ''))
  end
  if f[7] and TERMINAL[f[8]] then
    lines[#lines + 1] = trace_line(f[7], f[8], f[8] ~= 'succeeded' and string.sub(f[9] or '', 1, 300) or nil)
  end
  return lines
end

-- The task leaves the happy path: write out its trace so far, once (see the header).
-- Call it before changing the fields trace_lines() reads.
local function materialize(id)
  local tk = K_TASK .. id
  local f = redis.call('HMGET', tk, unpack(TRACE_FIELDS))
  if f[1] ~= '0' then return end  -- stored already (or a task of an older mtq)
  local lines = trace_lines(f)
  if #lines > 0 then redis.call('RPUSH', K_TRACE .. id, unpack(lines)) end
  redis.call('HSET', tk, 'trace', '1')
end

-- A line off the happy path: the trace is stored from now on.
local function note(id, now, kind, detail)
  materialize(id)
  redis.call('RPUSH', K_TRACE .. id, trace_line(now, kind, detail))
end

-- Scheduling (see the header). Is it on for this queue? Read once per script call.
local SCHED_ON = nil
local function sched_on()
  if SCHED_ON == nil then SCHED_ON = redis.call('HGET', K_STATS, 'sched') == '1' end
  return SCHED_ON
end
-- Scheduling's functions and state, made by sched_lib() (the end of this file) at a
-- call's first use: a closure costs every call that makes it, and a queue without
-- scheduling never needs these.
local SCH = nil
local sched_lib  -- (defined last: it closes over nothing)
local function sch()
  if not SCH then SCH = sched_lib() end
  return SCH
end

-- Finished tasks' latencies and failures, written once per script by flush_replies().
local LATENCIES, FAILURES = {}, {}

-- Publish what reply() queued, in life-cycle order (tokens before done), and
-- record the latencies and failures finish() gathered.
local function flush_replies()
  if SCH then SCH.flush() end
  if #LATENCIES > 0 then
    -- trimmed back to LATENCY_KEEP once it is LATENCY_SLACK longer (readers read the
    -- first LATENCY_KEEP): one command per call, not two. A list this call made gets
    -- the default expiry of diagnostics (a worker's beat sets the queue's own)
    local n = redis.call('LPUSH', K_LATENCY, unpack(LATENCIES))
    if n > LATENCY_KEEP + LATENCY_SLACK then
      redis.call('LTRIM', K_LATENCY, 0, LATENCY_KEEP - 1)
    elseif n == #LATENCIES then
      redis.call('PEXPIRE', K_LATENCY, DIAG_TTL_MS)
    end
    LATENCIES = {}
  end
  if #FAILURES > 0 then
    if redis.call('LPUSH', K_FAILURES, unpack(FAILURES)) == #FAILURES then
      redis.call('PEXPIRE', K_FAILURES, DIAG_TTL_MS)
    end
    redis.call('LTRIM', K_FAILURES, 0, FAILURES_KEEP - 1)
    FAILURES = {}
  end
  for _, kind in ipairs(REPLY_KINDS) do
    local by = REPLIES[kind]
    if by then
      for channel, items in pairs(by) do
        redis.call(PUBLISH, channel, cmsgpack.pack({kind, NOW_US, items}))
      end
    end
  end
  REPLIES = {}
end

local function event(name, now, extra)
  extra = extra or {}
  extra['event'] = name
  extra['ts'] = now
  redis.call(PUBLISH, EVENTS, cjson.encode(extra))
end

-- Make sure the stream-less marker is in the ring (at most one live marker).
local function free_mark()
  if redis.call('HGET', K_STATS, 'free_marked') ~= '1' then
    redis.call('HSET', K_STATS, 'free_marked', '1')
    redis.call('RPUSH', K_READY, FREE)
    return 1
  end
  return 0
end

-- The free list of lane (b, t) has work: its marker in its ring, the tenant a candidate
-- of the band (scheduling on). Returns 1 if the marker was not there (wake a worker).
local function lane_mark(b, t)
  -- (the lane ('s', '') is made a candidate by each claim that finds K_READY not empty)
  if b == 's' and t == '' then return free_mark() end
  return sch().mark(b, t)
end

-- Stream s (not busy, not empty) becomes claimable: into the ring of its head's lane
-- (scheduling on; b, t: that lane if the caller knows it, else read here), or K_READY.
-- at_head: it goes first (a requeued task).
local function ring_push(s, at_head, b, t)
  -- (the lane ('s', '') keeps K_READY, and each claim that finds it not empty makes it a
  -- candidate: no need to know whether the queue schedules)
  if not (b == 's' and t == '') and sched_on() then return sch().ring_push(s, at_head, b, t) end
  redis.call(at_head and 'LPUSH' or 'RPUSH', K_READY, s)
end

-- Wake up to n sleeping workers, keeping the marker list at most cap long.
local function wake(n, cap)
  if n <= 0 or cap <= 0 then return end
  local m = {}
  for i = 1, math.min(n, cap) do m[i] = '1' end
  -- one command when under the cap (the usual case), a trim back to it when over
  if redis.call('RPUSH', K_WAKE, unpack(m)) > cap then redis.call('LTRIM', K_WAKE, 0, cap - 1) end
end

-- Wake one sleeper unless a marker is already waiting.
local function nudge()
  if redis.call('LLEN', K_WAKE) == 0 then redis.call('RPUSH', K_WAKE, '1') end
end

-- The stream has no running task any more: make it claimable if it has work.
local function release_stream(s)
  redis.call('SREM', K_BUSY, s)
  if redis.call('LLEN', K_STREAM .. s) > 0 then
    ring_push(s, false)
    return 1
  end
  return 0
end

-- Queue a task at the tail of its stream (s: a name, or false / '' for none) or of
-- the free list. Returns two counts (0 or 1): the stream or the free list became
-- claimable (wake a worker), and the stream list was empty before (stats 'streams').
-- b, t: the task's lane (nil: the lane ('s', '')).
local function push_tail(id, s, b, t)
  b, t = b or 's', t or ''
  if s and s ~= '' then
    if redis.call('RPUSH', K_STREAM .. s, id) == 1 then
      if redis.call('SISMEMBER', K_BUSY, s) == 0 then
        ring_push(s, false, b, t)
        return 1, 1
      end
      return 0, 1
    end
    return 0, 0
  elseif redis.call('RPUSH', (b == 's' and t == '') and K_FREE or sch().lane_free(b, t), id) == 1 then
    return lane_mark(b, t), 0
  end
  return 0, 0
end

-- Put a task back at the head of its stream (or of the free list), claimable at once.
local function requeue_head(id, s)
  redis.call('HSET', K_TASK .. id, 'status', 'queued')
  local b, t = 's', ''
  if sched_on() then
    local f = redis.call('HMGET', K_TASK .. id, 'band', 'tenant', 'cost')
    b, t = f[1] or 's', f[2] or ''
    sch().lane_count(b, t, 1, tonumber(f[3] or '1'), 0)
  end
  if s then
    if redis.call('LPUSH', K_STREAM .. s, id) == 1 then
      redis.call('HINCRBY', K_STATS, 'streams', 1)
    end
    redis.call('SREM', K_BUSY, s)
    ring_push(s, true, b, t)
  else
    redis.call('LPUSH', (b == 's' and t == '') and K_FREE or sch().lane_free(b, t), id)
    lane_mark(b, t)
  end
  redis.call('HINCRBY', K_STATS, 'waiting', 1)
end

-- Record a terminal state: status, time, retention, and the done message to its client.
-- own: the result cache entry suffix the task owns and that must be freed, false for
-- none (or one that answers from now on: ack.lua), nil: not known, read it here.
-- h: {reply, created, trace, out, ...} as the caller read them (what follows the fourth
-- is not looked at), or nil: read them here.
local function finish(id, status, now, ttl, field, value, own, h)
  local tk = K_TASK .. id
  if field then
    redis.call('HSET', tk, 'status', status, 'finished', num(now), field, value)
  else
    redis.call('HSET', tk, 'status', status, 'finished', num(now))
  end
  if not h then
    h = redis.call('HMGET', tk, 'reply', 'created', 'trace', 'out', 'cache')
    if own == nil then own = h[5] end
  end
  local v = value or ''
  local stored = h[3] ~= '0'  -- the trace is a list (see the header)
  if stored then
    redis.call('RPUSH', K_TRACE .. id, trace_line(now, status, status ~= 'succeeded' and string.sub(v, 1, 300) or nil))
  end
  if ttl > 0 then
    local ttl_s = num(ttl)
    redis.call('EXPIRE', tk, ttl_s)
    -- a task of an older mtq ('trace' not set) may have tokens without 'out'
    if h[4] or not h[3] then redis.call('EXPIRE', K_OUT .. id, ttl_s) end
    if stored then redis.call('EXPIRE', K_TRACE .. id, ttl_s) end
  end
  if own then
    -- it owns a result cache entry that must not answer (it failed, was cancelled,
    -- expired, or its result may not be cached): free it
    local ek = K_CACHE .. own
    if redis.call('GET', ek) == id then
      redis.call('DEL', ek)
      redis.call('ZREM', K_CACHEX, own)  -- mtq_cache_entries counts what is held
    end
  end
  if status ~= 'cancelled' and status ~= 'expired' and h[2] then
    LATENCIES[#LATENCIES + 1] = num(now - tonumber(h[2]))  -- (a batch shares a few values)
  end
  if status == 'failed' or status == 'dead' or status == 'expired' then
    FAILURES[#FAILURES + 1] = cjson.encode({id = id, status = status, ts = now,
      error = string.sub(v, 1, 300)})
  end
  if status == 'succeeded' and #v > REPLY_INLINE then v = false end
  reply('done', h[1], id, status, v)
end

-- Dead-letter a task; the list keeps at most dead_max ids (the oldest are deleted).
local function dead_letter(id, now, dead_ttl, dead_max, err)
  finish(id, 'dead', now, dead_ttl, 'error', err)
  if redis.call('LPUSH', K_DEAD, id) > dead_max then
    local old = redis.call('RPOP', K_DEAD)
    -- the id may have been reused by a live task after the old hash expired
    if old and old ~= id and redis.call('HGET', K_TASK .. old, 'status') == 'dead' then
      redis.call('DEL', K_TASK .. old, K_OUT .. old, K_TRACE .. old)
    end
  end
  redis.call('HINCRBY', K_STATS, 'dead_total', 1)
end

-- Take back one running task whose worker is gone (lease expired, or its
-- supervisor saw the process die): back to the head of its stream, or dead as
-- poison after max_deliveries, or cancelled if a cancel was requested while it
-- ran. f = HMGET of status, stream, deliveries, cancel. The lease is already
-- removed. Returns 'requeued', 'dead' or 'cancelled', and 1 if that made its
-- stream claimable (the caller wakes a sleeper).
local function reclaim(id, f, now, max_deliveries, ttl, dead_ttl, dead_max, why)
  local s = f[2]
  local what = 'requeued'
  local charged = redis.call('HGET', K_TASK .. id, 'weight')
  if charged then sch().uncount(charged) end  -- charged at its claim: counted running
  if f[4] then
    finish(id, 'cancelled', now, ttl)
    redis.call('HINCRBY', K_STATS, 'cancelled', 1)
    what = 'cancelled'
  elseif tonumber(f[3] or '0') >= max_deliveries then
    -- a handler's traceback from an earlier attempt is not this death's
    redis.call('HDEL', K_TASK .. id, 'traceback')
    dead_letter(id, now, dead_ttl, dead_max,
      'PoisonTask: ' .. why .. ' on each of ' .. f[3] .. ' deliveries')
    what = 'dead'
  else
    materialize(id)
    requeue_head(id, s)
    note(id, now, 'restarted', why)
    reply('restarted', redis.call('HGET', K_TASK .. id, 'reply'), id, tonumber(f[3] or '0'), why)
    return what, 1
  end
  if s then return what, release_stream(s) end
  return what, 0
end

-- Publish what reclaim() did, grouped: by = {requeued = ids, dead = ids, cancelled = ids}.
local function reclaim_events(by, now)
  if #by.requeued > 0 then
    redis.call('HINCRBY', K_STATS, 'redelivered', #by.requeued)
    event('restarted', now, {ids = by.requeued})
  end
  if #by.dead > 0 then event('dead', now, {ids = by.dead}) end
  if #by.cancelled > 0 then event('cancelled', now, {ids = by.cancelled}) end
end

-- Reclaim tasks whose lease expired (their worker died or hung). Returns the
-- number of expired leases handled.
local function reap_expired(now, limit, max_deliveries, ttl, dead_ttl, dead_max)
  local ids = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'LIMIT', 0, limit)
  if #ids == 0 then return 0 end
  local by = {requeued = {}, dead = {}, cancelled = {}}
  for _, id in ipairs(ids) do
    redis.call('ZREM', K_LEASES, id)
    local f = redis.call('HMGET', K_TASK .. id, 'status', 'stream', 'deliveries', 'cancel')
    if f[1] == 'running' then
      local what = reclaim(id, f, now, max_deliveries, ttl, dead_ttl, dead_max, 'lease expired')
      by[what][#by[what] + 1] = id
    end
  end
  reclaim_events(by, now)
  return #ids
end

-- A task submitted with a delay ('due' in its hash) is due: queued at the tail of its
-- stream (or of the free list) as a submit at its due time would have queued it, and
-- counted waiting; its deadline (due + its ttl, see submit.lua) joins the deadlines'
-- index. Returns 1 if its stream or the free list became claimable (wake a worker).
local function enqueue_due(id, s)
  local tk = K_TASK .. id
  local f = redis.call('HMGET', tk, 'band', 'tenant', 'cost', 'deadline')
  local b, t = f[1] or 's', f[2] or ''
  redis.call('HSET', tk, 'status', 'queued')
  redis.call('HDEL', tk, 'due', 'dseq')  -- (a retry of it later goes back to the head)
  if sched_on() then sch().lane_count(b, t, 1, tonumber(f[3] or '1'), 0) end
  local claimable, new_stream = push_tail(id, s or '', b, t)
  if new_stream == 1 then redis.call('HINCRBY', K_STATS, 'streams', 1) end
  redis.call('HINCRBY', K_STATS, 'waiting', 1)
  if f[4] then
    redis.call('ZADD', K_SCHED .. 'deadlines', f[4], id)
    if redis.call('HGET', K_STATS, 'dl') ~= '1' then redis.call('HSET', K_STATS, 'dl', '1') end
  end
  return claimable
end

-- Move what is due in the delayed set on: a retry back to the head of its stream (which
-- it kept busy), a delayed submit to the tail of its stream (enqueue_due). Returns how
-- many entries were due, and how many streams or free lists became claimable.
local function promote_due(now, limit)
  local got = redis.call('ZRANGEBYSCORE', K_DELAYED, '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)
  if #got == 2 * limit then
    -- the last due time's entries whole: a tie cut here would let a later one go first
    local all = redis.call('ZRANGEBYSCORE', K_DELAYED, got[#got], got[#got], 'WITHSCORES')
    while #got > 0 and got[#got] == all[2] do got[#got] = nil; got[#got] = nil end
    for j = 1, #all do got[#got + 1] = all[j] end
  end
  -- ties (one submit_many, the same at=) go in submit order ('dseq'), not the set's
  -- order of random ids; the set's order (score, then id) stands when no two entries
  -- share a due time, and their 'dseq' is read only when two do
  local ids, tied = {}, false
  for j = 1, #got, 2 do
    ids[#ids + 1] = got[j]
    if j > 1 and got[j + 1] == got[j - 1] then tied = true end
  end
  if tied then
    local key = {}
    for j = 1, #got, 2 do
      local id = got[j]
      key[id] = {tonumber(got[j + 1]), tonumber(redis.call('HGET', K_TASK .. id, 'dseq') or '0')}
    end
    table.sort(ids, function(a, b)
      local x, y = key[a], key[b]
      if x[1] ~= y[1] then return x[1] < y[1] end
      if x[2] ~= y[2] then return x[2] < y[2] end
      return a < b
    end)
  end
  local woken = 0
  for _, id in ipairs(ids) do
    redis.call('ZREM', K_DELAYED, id)
    local f = redis.call('HMGET', K_TASK .. id, 'status', 'stream', 'due')
    if f[1] == 'delayed' then
      if f[3] then woken = woken + enqueue_due(id, f[2]) else requeue_head(id, f[2]) end
    end
  end
  return #ids, woken
end

-- Milliseconds until the entry ZRANGE key 0 0 WITHSCORES returned is due (0: due now);
-- -1 for none (an empty set, or only the leases' LEASE_MARK).
local function due_in(first, now)
  if first[2] and first[1] ~= LEASE_MARK then return math.max(0, tonumber(first[2]) - now) end
  return -1
end

-- Milliseconds until the earliest lease deadline or retry is due; -1 if none. known:
-- key -> what the caller's own ZRANGE of it returned, still true (false or nil: read it).
local function next_timer(now, known)
  local nxt = -1
  for _, key in ipairs({K_LEASES, K_DELAYED}) do
    local first = known and known[key] or redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    local d = due_in(first, now)
    if d >= 0 and (nxt < 0 or d < nxt) then nxt = d end
  end
  return nxt
end

-- Scheduling's functions (see sch() above): made once per call that needs them. It
-- reads what it needs of the script (KEYS) itself: an upvalue costs every call that
-- makes the closure (Lua 5.1 walks the open upvalues for each), and this one is made
-- by every script that may need it.
function sched_lib()
  local K_TASK, K_STREAM, K_READY, K_STATS = KEYS[1], KEYS[2], KEYS[3], KEYS[9]
  local K_FREE, K_SCHED, FREE = KEYS[10], KEYS[21], ''
  local num = tostring
  -- Per-lane counts (scheduling on; see 'count' in the header), summed here and written
  -- once per script call by flush_counts() (flush_replies() calls it).
  local LANE_COUNTS = {}
  local function lane_count(band, tenant, waiting, cost, running)
    local l = (band or 's') .. ':' .. (tenant or '')
    local e = LANE_COUNTS[l]
    if not e then
      e = {0, 0, 0}
      LANE_COUNTS[l] = e
    end
    e[1], e[2], e[3] = e[1] + waiting, e[2] + cost, e[3] + running
  end
  -- A number as a hash field's value: a whole one as such, else all its digits.
  local function fmt(v)
    if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return string.format('%d', v) end
    return string.format('%.17g', v)
  end
  -- Add deltas (field -> number) to the fields of hash key: two commands, however many.
  local function add_fields(key, deltas)
    local names = {}
    for f in pairs(deltas) do names[#names + 1] = f end
    if #names == 0 then return end
    if #names == 1 then  -- one command (HINCRBY for a count, '|w' or '|r': no float printed)
      local f, d = names[1], deltas[names[1]]
      local suffix = string.sub(f, -2)
      redis.call((suffix == '|w' or suffix == '|r') and 'HINCRBY' or 'HINCRBYFLOAT', key, f, d)
      return
    end
    local old = redis.call('HMGET', key, unpack(names))
    local set = {}
    for i, f in ipairs(names) do
      set[#set + 1] = f
      set[#set + 1] = fmt((tonumber(old[i] or '0') or 0) + deltas[f])
    end
    redis.call('HSET', key, unpack(set))
  end
  local function flush_counts()
    local d = {}
    for l, e in pairs(LANE_COUNTS) do
      if e[1] ~= 0 then d[l .. '|w'] = e[1] end
      if e[2] ~= 0 then
        d[l .. '|c'] = e[2]
        -- each band's waiting cost, for deadline admission
        local b = string.sub(l, 1, 1) .. '|c'
        d[b] = (d[b] or 0) + e[2]
      end
      if e[3] ~= 0 then d[l .. '|r'] = e[3] end
    end
    add_fields(K_SCHED .. 'count', d)
    LANE_COUNTS = {}
  end


  local BANDS = {'i', 's', 'b'}

  -- The ring and the free list of lane (b, t).
  local function lane_ring(b, t)
    if b == 's' and t == '' then return K_READY end
    return K_SCHED .. 'ready:' .. b .. ':' .. t
  end
  local function lane_free(b, t)
    if b == 's' and t == '' then return K_FREE end
    return K_SCHED .. 'free:' .. b .. ':' .. t
  end

  -- Tenant t has work in band b: make it a candidate of the band's claims. A tenant that
  -- was in no band comes back at the virtual clock if it is behind it (no banked credit).
  local ACTIVE = {}  -- lanes this call made or found candidates (see leave())
  local function activate(b, t)
    local l = b .. ':' .. t
    if ACTIVE[l] then return end
    ACTIVE[l] = true
    local bk = K_SCHED .. 'band:' .. b
    if redis.call('ZSCORE', bk, t) then return end
    local v = redis.call('HMGET', K_SCHED .. 'vt', t, '~V')
    local own, clock = tonumber(v[1] or '0'), tonumber(v[2] or '0')
    if own < clock then
      own = clock
      redis.call('HSET', K_SCHED .. 'vt', t, num(own))
      for _, o in ipairs(BANDS) do
        if o ~= b then redis.call('ZADD', K_SCHED .. 'band:' .. o, 'XX', num(own), t) end
      end
    end
    redis.call('ZADD', bk, num(own), t)
    redis.call('SADD', K_SCHED .. 'lanes', l)
  end
  -- tenant t is no candidate of band b any more (its lane has nothing claimable)
  local function leave(b, t)
    redis.call('ZREM', K_SCHED .. 'band:' .. b, t)
    ACTIVE[b .. ':' .. t] = nil
  end

  -- Tenant -> number, from a setting's text: the weights, "tenant=weight,..." (unknown
  -- tenants: 1), and the rate limits per minute, "tenant=N,...,*=N" ('*': every tenant
  -- not named; tasks without a tenant have none: see the header).
  local function weights_of(text)
    local w = {}
    for t, v in string.gmatch(text or '', '([^,=]+)=([^,]+)') do w[t] = tonumber(v) end
    return w
  end
  local limits_of = weights_of

  -- Costs a worker reports, from "index=cost,..." (index: the task's place in the call,
  -- from 1); a task without one keeps the cost its claim charged.
  local function costs_of(text)
    local c = {}
    for i, v in string.gmatch(text or '', '(%d+)=([^,]+)') do c[tonumber(i)] = tonumber(v) end
    return c
  end

  -- Milliseconds until tenant t may start n more requests (and, in cost, be no more than
  -- a second of its budget ahead); 0: now. rpm, tpm: limits_of() tables.
  local function rate_wait(t, n, now, rpm, tpm)
    if t == '' then return 0 end
    local R, C = rpm[t] or rpm['*'], tpm[t] or tpm['*']
    if not R and not C then return 0 end
    local v = redis.call('HMGET', K_SCHED .. 'rate', t .. '|r', t .. '|c')
    local wait = 0
    if R then
      -- GCRA with a burst of one second's worth (at least one request)
      local T = 60000 / R
      local tau = T * (math.max(1, math.ceil(R / 60)) - 1)
      wait = math.max(tonumber(v[1] or '0'), now) + (n - 1) * T - tau - now
    end
    if C then wait = math.max(wait, math.max(tonumber(v[2] or '0'), now) - 1000 - now) end
    return math.max(0, math.ceil(wait))
  end
  -- Tenant t started n requests of total cost c: advance its limits' state.
  local function rate_charge(t, n, c, now, rpm, tpm)
    if t == '' then return end
    local R, C = rpm[t] or rpm['*'], tpm[t] or tpm['*']
    if not R and not C then return end
    local v = redis.call('HMGET', K_SCHED .. 'rate', t .. '|r', t .. '|c')
    local f = {}
    if R then
      f[#f + 1] = t .. '|r'
      f[#f + 1] = math.max(tonumber(v[1] or '0'), now) + n * 60000 / R
    end
    if C and c > 0 then
      f[#f + 1] = t .. '|c'
      f[#f + 1] = math.max(tonumber(v[2] or '0'), now) + c * 60000 / C
    end
    if #f > 0 then redis.call('HSET', K_SCHED .. 'rate', unpack(f)) end
  end

  -- Settlement (ack, nack): what the tasks' reported costs change, summed per tenant
  -- (virtual time) and lane (served cost) and written once per call by flush_settled().
  local SETTLED_VT, SETTLED_COST = {}, {}
  -- A claim's charge, as it stored it in the task's 'weight': "weight|band|tenant".
  local function charged_of(v)
    local w, b, t = string.match(v, '^([^|]*)|(.)|(.*)$')
    return tonumber(w) or 1, b or 's', t or ''
  end
  -- n tasks their claims charged (charged: their 'weight') leave the running count
  local function uncount(charged, n)
    local _, b, t = charged_of(charged)
    lane_count(b, t, 0, 0, -(n or 1))
  end
  -- the cost a worker reported (actual) for a task its claim charged (charged: its
  -- 'weight'), against its estimate (cost: its 'cost')
  local function settle_cost(charged, cost, actual)
    if not charged or not actual then return end  -- not charged (scheduling off), or no report
    local d = actual - tonumber(cost or '1')
    if d == 0 then return end
    local w, b, t = charged_of(charged)
    SETTLED_VT[t] = (SETTLED_VT[t] or 0) + d / w
    SETTLED_COST[b .. ':' .. t] = (SETTLED_COST[b .. ':' .. t] or 0) + d
  end
  local function flush_settled()
    for t, dv in pairs(SETTLED_VT) do
      local v = redis.call('HINCRBYFLOAT', K_SCHED .. 'vt', t, dv)
      for _, b in ipairs(BANDS) do redis.call('ZADD', K_SCHED .. 'band:' .. b, 'XX', v, t) end
    end
    for l, d in pairs(SETTLED_COST) do redis.call('HINCRBYFLOAT', K_SCHED .. 'served', l, d) end
    SETTLED_VT, SETTLED_COST = {}, {}
  end


  -- Deadlines (see the header): queued tasks whose deadline passed end expired where they
  -- wait; the id stays in its list as a tombstone, its hash kept until claim pops it (as
  -- a cancelled one's), so that the id cannot be reused while the list names it.
  local function expire_due(now, limit, finish, event)
    local dk = K_SCHED .. 'deadlines'
    local ids = redis.call('ZRANGEBYSCORE', dk, '-inf', now, 'LIMIT', 0, limit)
    if #ids == 0 then return 0 end
    redis.call('ZREM', dk, unpack(ids))
    local gone = {}
    for _, id in ipairs(ids) do
      local f = redis.call('HMGET', K_TASK .. id, 'status', 'band', 'tenant', 'cost', 'deadline')
      -- (its own deadline: an id cancelled with one and used again has another task)
      if f[1] == 'queued' and tonumber(f[5] or '') and tonumber(f[5]) <= now then
        finish(id, 'expired', now, 0)
        lane_count(f[2], f[3], -1, -tonumber(f[4] or '1'), 0)
        gone[#gone + 1] = id
      end
    end
    if #gone > 0 then
      redis.call('HINCRBY', K_STATS, 'waiting', -#gone)
      redis.call('HINCRBY', K_STATS, 'expired', #gone)
      event('expired', now, {ids = gone})
    end
    return #ids
  end

  -- the lane's free list has work (not the lane ('s', ''): lane_mark() above)
  local function mark(b, t)
    local m = 0
    if redis.call('HSETNX', K_SCHED .. 'marked', b .. ':' .. t, '1') == 1 then
      redis.call('RPUSH', lane_ring(b, t), FREE)
      m = 1
    end
    activate(b, t)
    return m
  end
  -- ring_push() above, scheduling on
  local function push_ring(s, at_head, b, t)
    if not b then
      local head = redis.call('LINDEX', K_STREAM .. s, 0)
      local f = redis.call('HMGET', K_TASK .. head, 'band', 'tenant')
      b, t = f[1] or 's', f[2] or ''
    end
    redis.call(at_head and 'LPUSH' or 'RPUSH', lane_ring(b, t), s)
    activate(b, t)
  end
  local function flush()
    if next(LANE_COUNTS) then flush_counts() end
    if next(SETTLED_VT) or next(SETTLED_COST) then flush_settled() end
  end
  return {BANDS = BANDS, lane_ring = lane_ring, lane_free = lane_free, activate = activate,
          lane_count = lane_count, weights_of = weights_of,
          costs_of = costs_of, limits_of = limits_of, rate_wait = rate_wait,
          rate_charge = rate_charge, settle_cost = settle_cost, uncount = uncount, mark = mark,
          add_fields = add_fields, leave = leave,
          ring_push = push_ring, expire_due = expire_due, flush = flush}
end
