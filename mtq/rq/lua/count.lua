--[[ count.lua -- count a delivery of the jobs a dead worker was running.
Called by the supervisor when a worker process died (or was killed for a hung call)
while a call was running: only the jobs of that call count, and only those the dead
worker still owned (a job whose lease expired and was taken over is not its own).
Each entry is "<deaths>:<cap>": how many times a process died while running the job,
and the most jobs it may share a call with from now on (half the fatal call's size,
at least 1), so that a poison job in a batched call is isolated by bisection while
the innocent jobs of its call complete.
KEYS[1] the owners (hash: job id -> "<worker name>|<token>")
KEYS[2] the delivery counts (hash: job id -> "<deaths>:<cap>")
ARGV[1] the dead worker's name   ARGV[2] the size of the fatal call
ARGV[3..] the job ids of the running call
Returns: {id1, deaths1, id2, deaths2, ...} for the ids still owned by that worker.
]]
local prefix = ARGV[1] .. '|'
local cap = math.max(1, math.floor(tonumber(ARGV[2]) / 2))
local out = {}
for i = 3, #ARGV do
  local owner = redis.call('HGET', KEYS[1], ARGV[i])
  if owner and string.sub(owner, 1, #prefix) == prefix then
    local old = redis.call('HGET', KEYS[2], ARGV[i]) or '0:0'
    local deaths = (tonumber(string.match(old, '^(%d+)')) or 0) + 1
    redis.call('HSET', KEYS[2], ARGV[i], deaths .. ':' .. cap)
    out[#out + 1] = ARGV[i]
    out[#out + 1] = deaths
  end
end
return out
