--[[ fence.lua -- read, under WATCH, what a worker must check before it finishes jobs.
Read-only. The caller WATCHes the jobs' hashes and dependents sets first, runs this,
and then commits its MULTI/EXEC only for the jobs whose owner entry holds its token
and whose status is still "started" (the reaper and RQ's own registry cleanup both
change the job hash, so a give-back after this read aborts the EXEC).
KEYS[1] the owners   KEYS[2..] pairs: job hash (rq:job:<id>), its dependents set
  (rq:job:<id>:dependents)
ARGV[1..] the job ids, in the order of the pairs
Returns: {owner value or '', status or '', number of dependents} per job, flattened.
]]
local out = {}
for i, id in ipairs(ARGV) do
  out[#out + 1] = redis.call('HGET', KEYS[1], id) or ''
  out[#out + 1] = redis.call('HGET', KEYS[2 * i], 'status') or ''
  out[#out + 1] = redis.call('SCARD', KEYS[2 * i + 1])
end
return out
