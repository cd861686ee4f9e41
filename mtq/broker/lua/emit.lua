--[[ emit.lua -- stream tokens (chunks) and progress of running tasks to their clients.
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] msgpack array of items {id, lease token, index (-1 = progress), data (msgpack bytes)}
  (one argument, not four per item: a publisher trip of 32 tokens costs the
  worker one packb instead of building 128 arguments)
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
local items = cmsgpack.unpack(ARGV[3])
now_ms()
local codes = {}
for i = 0, #items - 1 do
  local item = items[i + 1]
  local id, token, index, data = item[1], item[2], tonumber(item[3]), item[4]
  local f = redis.call('HMGET', K_TASK .. id, 'status', 'token', 'reply', 'out')
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
      if not f[4] then  -- finish() expires the token list only if this is set
        redis.call('HSET', K_TASK .. id, 'out', '1')
        f[4] = '1'
      end
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
