--[[ extend.lua -- extend the leases of running tasks (the worker heartbeat).
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] lease ms   ARGV[4] n, then n pairs: id, lease token
Returns: one code per task: 1 = extended; 2 = extended, and a cancel was
  requested (the worker should stop it and nack it with 'cancel');
  E_LEASE_LOST = not running under this token: stop working on it.
]]
--@include _lib.lua
local lease, n = tonumber(ARGV[3]), tonumber(ARGV[4])
local until_ms = now_ms() + lease
local codes = {}
for i = 0, n - 1 do
  local id, token = ARGV[5 + i * 2], ARGV[6 + i * 2]
  local f = redis.call('HMGET', K_TASK .. id, 'status', 'token', 'cancel')
  if f[1] ~= 'running' or f[2] ~= token then
    codes[i + 1] = E_LEASE_LOST
  else
    redis.call('ZADD', K_LEASES, 'XX', until_ms, id)
    if f[3] then codes[i + 1] = 2 else codes[i + 1] = 1 end
  end
end
return codes
