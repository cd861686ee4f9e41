--[[ orphans.lua -- the tasks still running under a worker id (read only).
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] worker id   ARGV[4] most leases to scan (0 = all)
Returns: a flat list id, lease token, id, lease token, ... of every task in the lease
  index whose status is 'running' and whose worker is ARGV[3].
A supervisor calls it after one of its processes died, to find the tasks that
process claimed but had not reported yet (a claim answered just before the kill),
and gives them back with nack 'release' (fenced by the tokens returned here).
Cost: O(running tasks of the queue); it runs only when a worker process dies.
]]
--@include _lib.lua
local worker, limit = ARGV[3], tonumber(ARGV[4])
local ids = redis.call('ZRANGE', K_LEASES, 0, limit > 0 and limit - 1 or -1)
local out = {}
for _, id in ipairs(ids) do
  local f = id ~= LEASE_MARK and redis.call('HMGET', K_TASK .. id, 'status', 'worker', 'token') or {}
  if f[1] == 'running' and f[2] == worker then
    out[#out + 1] = id
    out[#out + 1] = f[3]
  end
end
return out
