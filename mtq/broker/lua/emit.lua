--[[ emit.lua -- stream tokens (chunks) and progress of running tasks to their clients.
KEYS: the standard thirteen (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] n, then n groups of 4: id, lease token, index (-1 = progress), data (msgpack)
A token is appended to the task's output list (the replay log a late subscriber
reads) and published on its reply channel, only if its index is the next one:
a redelivered task regenerates its stream from index 0, and the tokens its
earlier delivery already streamed are skipped here, so the client sees each
index once and in order. Fenced like ack: a worker whose lease was lost cannot
write into the stream of the worker that took over.
Returns: one code per item: 1 = streamed; 0 = skipped (index already streamed);
  E_LEASE_LOST = not running under this token (stop generating it);
  E_BAD_ARGUMENT = an index past the next one (a gap; nothing written).
]]
--@include _lib.lua
local n = tonumber(ARGV[3])
now_ms()
local codes = {}
for i = 0, n - 1 do
  local b = 4 + i * 4
  local id, token, index, data = ARGV[b], ARGV[b + 1], tonumber(ARGV[b + 2]), ARGV[b + 3]
  local f = redis.call('HMGET', K_TASK .. id, 'status', 'token', 'reply')
  if f[1] ~= 'running' or f[2] ~= token then
    codes[i + 1] = E_LEASE_LOST
  elseif index < 0 then
    reply('progress', f[3], id, data)
    codes[i + 1] = 1
  else
    local ok = K_OUT .. id
    local len = redis.call('LLEN', ok)
    if index == len then
      redis.call('RPUSH', ok, data)
      reply('token', f[3], id, index, data)
      codes[i + 1] = 1
    elseif index < len then
      codes[i + 1] = 0
    else
      codes[i + 1] = E_BAD_ARGUMENT
    end
  end
end
flush_replies()
return codes
