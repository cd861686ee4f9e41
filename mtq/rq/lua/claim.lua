--[[ claim.lua -- take up to N job ids from the head of an RQ queue and lease them.
The pop and the lease are one atomic step: a worker killed at any instant either
never had the ids (they are still in the queue) or holds them in the lease index,
where the reaper finds them.
KEYS[1] the RQ queue list (rq:queue:<name>)   KEYS[2] the lease index (sorted set:
  job id -> lease deadline, ms, server clock)   KEYS[3] the owners (hash: job id ->
  "<worker name>|<token>")   KEYS[4] the token counter
ARGV[1] worker name   ARGV[2] N (most ids to take)   ARGV[3] lease ms
Returns: {} when the queue is empty, else {first token, id1, id2, ...}: id i has token
  first token + i - 1. Tokens grow with every claim: they fence (a worker finishes a
  job only while the owner entry still holds its token) and order the give-back.
]]
local ids = redis.call('LPOP', KEYS[1], tonumber(ARGV[2]))
if not ids then return {} end
local t = redis.call('TIME')
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[3])
local first = redis.call('INCRBY', KEYS[4], #ids) - #ids + 1
local z, h = {}, {}
for i, id in ipairs(ids) do
  z[#z + 1] = deadline
  z[#z + 1] = id
  h[#h + 1] = id
  h[#h + 1] = ARGV[1] .. '|' .. (first + i - 1)
end
redis.call('ZADD', KEYS[2], unpack(z))
redis.call('HSET', KEYS[3], unpack(h))
local out = {first}
for _, id in ipairs(ids) do out[#out + 1] = id end
return out
