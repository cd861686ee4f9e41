--[[ watch.lua -- read a task's state and stored output, and make sure its events reach a client.
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] task id   ARGV[4] the client's reply channel   ARGV[5] first output index to
  return (-1: none)   ARGV[6] most reply channels a task may carry
A task carries the reply channel of the client that submitted it; a client that
waits on a task it did not submit (another process, the CLI) has its own channel
added here, so one subscription per client serves every task it waits on.
Returns: {} when there is no such task; else {status, result or '', error or '',
  deliveries, {data of tokens ARGV[5].. in index order}, server time in us} (a
  reader drops live events published before that time: the state includes them).
]]
--@include _lib.lua
local id, channel, from, cap = ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local tk = K_TASK .. id
now_ms()
local f = redis.call('HMGET', tk, 'status', 'result', 'error', 'deliveries', 'reply')
if not f[1] then return {} end
local status = f[1]
local terminal = status == 'succeeded' or status == 'failed' or status == 'dead' or
  status == 'cancelled' or status == 'expired'
if channel ~= '' and not terminal then
  local current = f[5] or ''
  local known, count = false, 0
  for c in string.gmatch(current, '%S+') do
    count = count + 1
    if c == channel then known = true end
  end
  if not known and count < cap then
    if current == '' then current = channel else current = current .. ' ' .. channel end
    redis.call('HSET', tk, 'reply', current)
  end
end
local tokens = {}
if from >= 0 then tokens = redis.call('LRANGE', K_OUT .. id, from, -1) end
return {status, f[2] or '', f[3] or '', tonumber(f[4] or '0'), tokens, NOW_US}
