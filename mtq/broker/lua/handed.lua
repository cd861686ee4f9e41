--[[ handed.lua -- chain hand-offs are complete: their records go, their streams are released.
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] n, then n ids of succeeded chained tasks whose hand-off is complete (the next
  step submitted, or the chain ended there: its task gone, its chain cancelled, its
  next step impossible to build)
ARGV[4 + n]... ids whose 'chainstop' to report (the steps just submitted: a chain
  cancelled while its next step went in has that step cancelled by the caller)
ARGV[3] = -1 instead: the sweep (recovery, when it counts more holds than records): each
  hold in K_HELD whose record is gone from K_HANDOFFS (removed by anything but this
  script: an operator's ZREM or DEL of the records) is dropped and its stream
  released, so no stream stays held with nothing left to release it. ack.lua writes a
  hold and its record in one call and this script removes both in one, so a hold
  without its record is never one a completer will still release: nothing is released
  twice. O(holds), run only when a hold has no record.
Returns: {removed, released, then one flag per id of ARGV[4 + n]...: 1 if its task
  has 'chainstop'}: removed, how many of the n records were still there (ZREM);
  released, how many streams that made claimable again.
Each record removed here releases the stream its ack held (K_HELD: see ack.lua and
_lib.lua), once: a record already gone (another completer came first: a slow worker
and a recoverer, a removal sent again) releases nothing. A task without a stream held
nothing. A sleeping worker is woken when a stream with work became claimable.
Cost: O(n).
]]
--@include _lib.lua
local n = tonumber(ARGV[3])
local removed, released = 0, 0
if n < 0 then  -- the sweep (see the header): removed counts the holds dropped
  n = 0
  for _, id in ipairs(redis.call('HKEYS', K_HELD)) do
    if not redis.call('ZSCORE', K_HANDOFFS, id) then
      local s = redis.call('HGET', K_HELD, id)
      redis.call('HDEL', K_HELD, id)
      removed = removed + 1
      -- (a stream no longer busy, its busy set deleted by hand, is not pushed on a ring
      -- it may already be on)
      if redis.call('SISMEMBER', K_BUSY, s) == 1 then released = released + release_stream(s) end
    end
  end
end
for i = 4, 3 + n do
  local id = ARGV[i]
  if redis.call('ZREM', K_HANDOFFS, id) == 1 then
    removed = removed + 1
    local s = redis.call('HGET', K_HELD, id)
    if s then
      redis.call('HDEL', K_HELD, id)
      released = released + release_stream(s)
    end
  end
end
local out = {removed, released}
for i = 4 + n, #ARGV do
  out[#out + 1] = redis.call('HEXISTS', K_TASK .. ARGV[i], 'chainstop')
end
if released > 0 then nudge() end
return out
