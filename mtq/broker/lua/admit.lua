--[[ admit.lua -- count one request against an API key's rate limits
(mtq.client.apikeys.admit): requests and tokens per minute, each a GCRA (generic cell
rate algorithm) whose burst is a whole minute's budget.
KEYS[1] the key's rate hash (mtq:apikey:{<id>}:rate: 'r', 'c' -> when its next
        request, its next token, is due; ms, Redis server time). An API key belongs
        to no queue: this script takes this one key, not the queues' twenty-two.
ARGV[1] rpm (0: none)   ARGV[2] tpm (0: none)   ARGV[3] tokens
Returns: '0' (admitted: one request and the tokens are counted) or the milliseconds
until the request would be admitted (nothing counted), as text.
]]
--@include _lib.lua
local rpm, tpm, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local MINUTE = 60000
local v = redis.call('HMGET', KEYS[1], 'r', 'c')
local wait = 0
local new_r, new_c
if rpm > 0 then
  local tat = math.max(tonumber(v[1] or '0') or 0, now)
  new_r = tat + MINUTE / rpm
  wait = math.max(wait, new_r - MINUTE - now)
end
if tpm > 0 then
  local tat = math.max(tonumber(v[2] or '0') or 0, now)
  local spend = tokens * MINUTE / tpm
  new_c = tat + spend
  if spend > MINUTE then
    -- more than a minute's budget: admitted once the key owes nothing
    wait = math.max(wait, tat - now)
  else
    wait = math.max(wait, new_c - MINUTE - now)
  end
end
-- float sums of 60000 / rpm may end a hair past the minute
if wait > 0.001 then return tostring(wait) end
local f, last = {}, now
if new_r then f[#f + 1] = 'r'; f[#f + 1] = tostring(new_r); last = math.max(last, new_r) end
if new_c then f[#f + 1] = 'c'; f[#f + 1] = tostring(new_c); last = math.max(last, new_c) end
if #f > 0 then
  redis.call('HSET', KEYS[1], unpack(f))
  redis.call('PEXPIRE', KEYS[1], math.ceil(last - now) + 1000)
end
return '0'
