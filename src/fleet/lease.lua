-- corral's fleet lease: one atomic call that leases tokens from a partition's shared buckets,
-- returns unused ones, shares what the caller learned and the pause of its 429s, and counts the
-- live replicas. Time is Redis's own (TIME), never a replica's.
--
-- KEYS[1] requests bucket (hash), KEYS[2] tokens bucket (hash), KEYS[3] pause (string: until,
-- ms), KEYS[4] live replicas (sorted set: replica -> last call, ms). All share one hash tag.
--
-- ARGV[1] replica id, ARGV[2] heartbeat TTL (ms), ARGV[3] "1" when the replica is leaving,
-- ARGV[4] pause to share (ms, 0: none), ARGV[5] buckets that refused with a 429 (0 none,
-- 1 requests, 2 tokens, 3 both); then for requests at 6 and tokens at 13: units wanted, units
-- returned, configured rate (units/s, 0: none) and burst, learned rate (0: none), burst and level
-- (-1: none); ARGV[20] the fleet's channel: a pause this call sets is published there
-- ("PAUSE-KEY pause MS"), so every replica stops at once, not at its next lease, and so is a
-- learned bucket it creates ("PAUSE-KEY learned"), so every replica leases from it, and its own
-- first call ("PAUSE-KEY joined"), so every replica counts it at once; ARGV[21] "1" when
-- the replica fell back since its last answer (Redis may have lost the buckets); ARGV[22] and
-- ARGV[23] the requests and tokens buckets' epochs the returned units came from: units of
-- another epoch (a bucket Redis lost) are not taken back. ARGV[24] "1" when the refusals of
-- ARGV[5] are a bucket's edge (the upstream's bucket was empty when it refused): they are
-- published ("PAUSE-KEY throttled BUCKETS REPLICA"), so every replica takes the moment as the
-- end of a throttle window (what it sent since the last one is its share of the refill).
-- ARGV[25] "RATE DEMAND" ("-": none): the caller's estimate of its share of the key's request
-- rate (from those windows, when the upstream reports no limit) and its demand, published
-- ("PAUSE-KEY share RATE DEMAND REPLICA"): the replicas add the shares up to the key's rate
-- and split it by demand. ARGV[26] and ARGV[27]: the requests and tokens the caller sent after
-- the attempt whose report its learned level is (the report has not seen them). ARGV[28]
-- "PACE DEMAND" ("-": none): the caller's pace, capped by the 429s of a key that reports no
-- limit, and its demand, published ("PAUSE-KEY pace PACE DEMAND REPLICA"): the replicas split
-- the sum of their paces by demand (a replica whose queue ran dry leaves its part to those
-- still queued). ARGV[29] "1" when the edge of ARGV[24] was the caller's first send after its
-- pause ended: the publication ends with " first" (a peer that saw every replica's first send
-- after a pause refused knows no bucket refilled over the wait it named: an admission control's).
--
-- Returns, per bucket (requests, then tokens): units granted, the level before the grant, the
-- rate, the burst (rate "0": nothing known, the bucket does not gate) and its epoch (set when
-- it is created); then the pause left
-- (ms) and the live replicas. A grant may take the level below zero: its units are usable as the
-- level refills (unit k of a grant from level L at rate r after (k - L) / r seconds), so grants
-- queue in the order they were asked for, a block each, instead of polling.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local throttled = tonumber(ARGV[5])
local resync = ARGV[21] == '1'

-- A learned burst is replaced by a larger one only when it is this old (ms): replicas that
-- learned less (no 429 seen yet) do not undo what one learned.
local LEARNED_KEEP = 30000
-- Grants queue at most this far ahead (s of refill): beyond, nothing is granted.
local MAX_AHEAD = 30

-- Other replicas live (heartbeats within the TTL), before this call counts.
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - ttl)
local member = redis.call('ZSCORE', KEYS[4], ARGV[1])
local others = redis.call('ZCARD', KEYS[4]) - (member and 1 or 0)

-- A learned bucket was created (or its burst shrank) by this call: the others are told to lease
-- from it.
local created = false

local function bucket(key, base, refused, epoch_arg, unseen_arg)
  local want = tonumber(ARGV[base])
  local unseen = tonumber(ARGV[unseen_arg] or '0') or 0
  local ret = tonumber(ARGV[base + 1])
  local cfg_rate, cfg_burst = tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local l_rate, l_burst, l_level =
    tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5]), tonumber(ARGV[base + 6])
  local b = redis.call('HMGET', key, 'rate', 'burst', 'level', 'ts', 'set', 'epoch')
  local rate, burst, level, ts, set =
    tonumber(b[1]), tonumber(b[2]), tonumber(b[3]), tonumber(b[4]), tonumber(b[5])
  local epoch = b[6]
  if cfg_rate > 0 then
    rate, burst, set = cfg_rate, cfg_burst, now
  elseif l_rate > 0 then
    if rate == nil or burst == nil or set == nil or now - set > LEARNED_KEEP or l_burst <= burst then
      -- A burst that shrinks (a report in another unit than the bucket, found out by a 429):
      -- the others hold units granted from the larger one, and are told at once; the level,
      -- counted in the old unit, is at most what the caller's report says in the new one.
      if burst ~= nil and l_burst < burst then
        created = true
        if level ~= nil and l_level >= 0 then level = math.min(level, l_level) end
      end
      burst, set = l_burst, now
    end
    rate = l_rate
  end
  if rate == nil or rate <= 0 then
    return {want, want, 0, 0, '-'}
  end
  if level == nil or ts == nil then
    -- A new bucket (or one Redis lost). Configured: full. Learned: what the report said, less
    -- what the replicas sent that it has not seen: the caller's own sends since, and as many
    -- for each other live replica (they pace alike until they lease). Splitting the report
    -- over the replicas instead threw away three quarters of a fresh burst for four of them.
    -- After a loss: empty, since the replicas spent the upstream's bucket at their shares
    -- meanwhile. (At most a burst is lost: it refills.)
    if resync then
      level = 0
    elseif cfg_rate > 0 or l_level < 0 then
      level = burst
    else
      level = math.max(0, math.min(l_level, burst) - (others + 1) * unseen)
    end
    if cfg_rate <= 0 then created = true end
    ts = now
    epoch = nil
  end
  if not epoch then
    epoch = now .. ':' .. ARGV[1]
  end
  -- Units handed back from a bucket that was lost do not belong to this one.
  if ARGV[epoch_arg] ~= epoch then ret = 0 end
  level = math.min(burst, level + rate * math.max(0, now - ts) / 1000)
  level = math.min(burst, level + ret)
  if refused then level = math.min(level, 0) end
  local before = level
  local grant = math.max(0, math.min(want, level + rate * MAX_AHEAD))
  level = level - grant
  redis.call('HSET', key, 'rate', rate, 'burst', burst, 'level', level, 'ts', now, 'set', set,
    'epoch', epoch)
  -- Kept until it would have refilled (and a minute more): then a new one starts full.
  redis.call('PEXPIRE', key, 60000 + math.ceil((burst - level) / rate * 1000))
  return {grant, before, rate, burst, epoch}
end

local req = bucket(KEYS[1], 6, throttled == 1 or throttled == 3, 22, 26)
local tok = bucket(KEYS[2], 13, throttled == 2 or throttled == 3, 23, 27)

local pause_ms = tonumber(ARGV[4])
local until_ms = tonumber(redis.call('GET', KEYS[3]) or '0')
if pause_ms > 0 and now + pause_ms > until_ms then
  until_ms = now + pause_ms
  redis.call('SET', KEYS[3], until_ms, 'PX', pause_ms)
  redis.call('PUBLISH', ARGV[20], KEYS[3] .. ' pause ' .. pause_ms)
end
if created then
  redis.call('PUBLISH', ARGV[20], KEYS[3] .. ' learned')
end
if throttled > 0 and ARGV[24] == '1' then
  local first = ARGV[29] == '1' and ' first' or ''
  redis.call('PUBLISH', ARGV[20], KEYS[3] .. ' throttled ' .. throttled .. ' ' .. ARGV[1] .. first)
end
if ARGV[25] and ARGV[25] ~= '-' then
  redis.call('PUBLISH', ARGV[20], KEYS[3] .. ' share ' .. ARGV[25] .. ' ' .. ARGV[1])
end
if ARGV[28] and ARGV[28] ~= '-' then
  redis.call('PUBLISH', ARGV[20], KEYS[3] .. ' pace ' .. ARGV[28] .. ' ' .. ARGV[1])
end

if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[4], ARGV[1])
else
  redis.call('ZADD', KEYS[4], now, ARGV[1])
  -- A replica new to the key (or back after its heartbeat lapsed) changes every replica's
  -- part: they are told at once ("PAUSE-KEY joined"), not at their next lease.
  if not member then
    redis.call('PUBLISH', ARGV[20], KEYS[3] .. ' joined')
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[4], ttl * 2)
local live = redis.call('ZCARD', KEYS[4])

local out = {}
for _, v in ipairs(req) do table.insert(out, tostring(v)) end
for _, v in ipairs(tok) do table.insert(out, tostring(v)) end
table.insert(out, tostring(math.max(0, until_ms - now)))
table.insert(out, tostring(live))
return out
