--[[ extend.lua -- extend the leases a worker still holds; report those it lost.
KEYS[1] the lease index   KEYS[2] the owners
ARGV[1] lease ms   ARGV[2..] pairs: job id, owner value ("<worker>|<token>")
Returns: the ids whose owner entry no longer holds that value (given back, or taken
  over): the worker must not start or finish them.
]]
local t = redis.call('TIME')
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local lost = {}
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZADD', KEYS[1], 'XX', deadline, ARGV[i])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
