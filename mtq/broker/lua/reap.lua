--[[ reap.lua -- reclaim expired leases and promote due retries without claiming.
KEYS: the standard twenty-two (see _lib.lua).
ARGV[1] events channel   ARGV[2] control channel
ARGV[3] max deliveries   ARGV[4] limit per call   ARGV[5] retention s
ARGV[6] dead-letter retention s   ARGV[7] dead-letter max length   ARGV[8] wake cap
Returns: {reaped, promoted, next_timer_ms}. Claim does the same work first on
every call, so a live worker pool needs no separate reaper; this script serves
supervisors and operators that want recovery while no worker is claiming.
]]
--@include _lib.lua
local max_deliveries, limit, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local dead_ttl, dead_max, cap = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local now = now_ms()
local reaped = reap_expired(now, limit, max_deliveries, ttl, dead_ttl, dead_max)
local promoted = promote_due(now, limit)  -- (wakes as many: a retry's stream is busy)
if reaped + promoted > 0 then wake(reaped + promoted, cap) end
flush_replies()
return {reaped, promoted, next_timer(now)}
