--[[ trace.lua -- read tasks' traces (read only).
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3..] task ids
Returns: one list per id of its trace lines, "ms|kind|detail", oldest first: the
  stored list, or for a task on the happy path (no list, 'trace' = '0') the lines
  its fields give (see "Trace" in _lib.lua). Empty for an unknown id.
]]
--@include _lib.lua
local out = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local f = redis.call('HMGET', K_TASK .. id, unpack(TRACE_FIELDS))
  if f[1] == '0' then
    out[#out + 1] = trace_lines(f)
  else
    out[#out + 1] = redis.call('LRANGE', K_TRACE .. id, 0, -1)
  end
end
return out
