--[[ handover.lua -- a running task now runs in another process than the one that
claimed it: its start names that process.
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] the worker id of the process that runs it   ARGV[4] task id   ARGV[5] lease token
Returns: 1, or E_LEASE_LOST (not running under this token: nothing changed).
A supervisor's quarantine process calls it as it takes a suspect that a serving
process claimed and handed over: the task's 'worker' and 'started' become the
runner's and now, and, if its trace is stored as a list, the claim's 'started' line
(the last one) is rewritten to name the runner, so that `mtq task ID` names the
process that called the model. The lease and its token stay the claimer's.
Cost: O(1) (the last few trace lines are read).
]]
--@include _lib.lua
local worker, id, token = ARGV[3], ARGV[4], ARGV[5]
local tk = K_TASK .. id
local f = redis.call('HMGET', tk, 'status', 'token', 'trace', 'deliveries')
if f[1] ~= 'running' or f[2] ~= token then return E_LEASE_LOST end
local now = now_ms()
redis.call('HSET', tk, 'worker', worker, 'started', num(now))
if f[3] ~= '0' then  -- a stored list (see "Trace" in _lib.lua): its last 'started' line
  local key = K_TRACE .. id
  local n = redis.call('LLEN', key)
  for i = n - 1, math.max(0, n - 8), -1 do
    local line = redis.call('LINDEX', key, i)
    if string.find(line, '|started|', 1, true) then
      redis.call('LSET', key, i, trace_line(now, 'started',
        'delivery ' .. (f[4] or '1') .. ' on ' .. worker))
      break
    end
  end
end
return 1
