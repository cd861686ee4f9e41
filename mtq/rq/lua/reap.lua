--[[ reap.lua -- give leased jobs back to the head of their RQ queue, in claim order.
Used for jobs whose lease expired (a frozen or dead worker), for every job of a
worker that died (its supervisor calls it at once), and by a worker for jobs it
claimed but will not start (warm shutdown).
KEYS[1] the RQ queue list   KEYS[2] the lease index   KEYS[3] the owners
  KEYS[4] RQ's StartedJobRegistry (rq:wip:<queue>)
  KEYS[5..] pairs: job hash (rq:job:<id>), its execution registry (rq:executions:<id>)
ARGV[1] mode: 'expired' (only if the lease deadline has passed), 'worker' (only if
  the owner is worker ARGV[2]), 'exact' (only if the owner value is ARGV[2+i])
ARGV[2] worker name (mode 'worker')
ARGV[3..] the job ids, in the order of the pairs; in mode 'exact' pairs of id, owner
  value follow instead (ARGV[3] id1, ARGV[4] owner1, ...)
Returns: the ids pushed back to the queue (a job whose hash is gone, or that was
  cancelled or finished meanwhile, loses its lease but is not pushed back).
]]
local mode, worker = ARGV[1], ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local take = {}
local step = (mode == 'exact') and 2 or 1
local n = 0
for a = 3, #ARGV, step do
  n = n + 1
  local id = ARGV[a]
  local owner = redis.call('HGET', KEYS[3], id)
  local ok = false
  if owner then
    if mode == 'expired' then
      local score = redis.call('ZSCORE', KEYS[2], id)
      ok = (not score) or tonumber(score) <= now
    elseif mode == 'worker' then
      ok = string.sub(owner, 1, #worker + 1) == worker .. '|'
    else
      ok = owner == ARGV[a + 1]
    end
  end
  if ok then
    local token = tonumber(string.match(owner, '|(%d+)$')) or 0
    take[#take + 1] = {token, id, KEYS[3 + 2 * n], KEYS[4 + 2 * n]}
  end
end
table.sort(take, function(x, y) return x[1] > y[1] end)
local back = {}
for _, e in ipairs(take) do
  local id, jobkey, execkey = e[2], e[3], e[4]
  redis.call('HDEL', KEYS[3], id)
  redis.call('ZREM', KEYS[2], id)
  for _, ex in ipairs(redis.call('ZRANGE', execkey, 0, -1)) do
    redis.call('ZREM', KEYS[4], id .. ':' .. ex)
  end
  redis.call('DEL', execkey)
  local status = redis.call('HGET', jobkey, 'status')
  if status == 'queued' or status == 'started' then
    redis.call('HSET', jobkey, 'status', 'queued')
    redis.call('LPUSH', KEYS[1], id)
    back[#back + 1] = id
  end
end
return back
