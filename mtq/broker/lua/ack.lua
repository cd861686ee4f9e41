--[[ ack.lua -- record the results of a batch, fenced by lease token.
KEYS: the standard nineteen (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] retention s   ARGV[4] n, then n groups of 3: id, lease token, result (msgpack)
Returns: one code per task: 1 = recorded; E_LEASE_LOST = the task is not running
  under this token any more (its lease expired and it was reclaimed, or it was
  already finished): nothing is changed, the result of the current owner stands.
]]
--@include _lib.lua
local ttl, n = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local codes, done, woken = {}, {}, 0
for i = 0, n - 1 do
  local b = 5 + i * 3
  local id, token = ARGV[b], ARGV[b + 1]
  local f = redis.call('HMGET', K_TASK .. id, 'status', 'token', 'stream')
  if f[1] ~= 'running' or f[2] ~= token then
    codes[i + 1] = E_LEASE_LOST
  else
    redis.call('ZREM', K_LEASES, id)
    finish(id, 'succeeded', now, ttl, 'result', ARGV[b + 2])
    if f[3] then woken = woken + release_stream(f[3]) end
    codes[i + 1] = 1
    done[#done + 1] = id
  end
end
if #done > 0 then
  redis.call('HINCRBY', K_STATS, 'succeeded', #done)
  event('succeeded', now, {ids = done})
end
if woken > 0 then nudge() end
flush_replies()
return codes
