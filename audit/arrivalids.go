package audit

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"sync"
	"time"
)

// orphanTTL is how long the ID of a delivery left unacked by an ended
// session waits for its redelivery before it is forgotten (the broker
// redelivers at once, but behind the messages of a long queue, or to
// another Consumer).
const orphanTTL = 30 * time.Minute

// publishIDs gives arrivals their per-publish ID (Arrival.ID) when the
// Store has no delivery log (with one, see unacked.go).
//
// RabbitMQ marks a delivery that was delivered before (basic.deliver's
// redelivered flag, "Consumer Acknowledgements and Publisher Confirms":
// Redeliveries); nothing else in a delivery tells two identical publishes
// apart. So: a first delivery is a publish never seen before and gets a
// new ID (its contentID hashed with a random nonce). Until it is acked the
// Consumer remembers that ID under its contentID; when the session ends
// (connection or channel lost) its unacked IDs become orphans, and a
// redelivery of the same content takes an orphan's ID: the record is
// written again under the same ID (a no-op if it had committed). A
// redelivery without an orphan (delivered first to another Consumer
// process, or this one restarted after a crash) gets a new ID and
// Arrival.MaybeDuplicate: if its first delivery had committed, the
// publish is stored twice, the second copy flagged; two publishes are
// never merged into one.
type publishIDs struct {
	mu      sync.Mutex
	unacked map[string][]string // contentID -> IDs delivered in this session, not acked
	orphans map[string][]orphan // contentID -> IDs left unacked by ended sessions
}

type orphan struct {
	id    string
	since time.Time
}

func newPublishIDs() *publishIDs {
	return &publishIDs{unacked: map[string][]string{}, orphans: map[string][]orphan{}}
}

// assign sets a.ID for a delivery of a.contentID.
func (p *publishIDs) assign(a *Arrival, redelivered bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	id := ""
	if redelivered {
		if os := p.orphans[a.contentID]; len(os) > 0 {
			id = os[0].id
			if len(os) == 1 {
				delete(p.orphans, a.contentID)
			} else {
				p.orphans[a.contentID] = os[1:]
			}
		}
	}
	if id == "" {
		a.MaybeDuplicate = redelivered
		var nonce [16]byte
		_, _ = rand.Read(nonce[:])
		sum := sha256.Sum256(append([]byte(a.contentID), nonce[:]...))
		id = hex.EncodeToString(sum[:])
	}
	a.ID = id
	p.unacked[a.contentID] = append(p.unacked[a.contentID], id)
}

// acked forgets the IDs of arrivals whose deliveries were acked.
func (p *publishIDs) acked(arrivals []Arrival) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := range arrivals {
		ids := p.unacked[arrivals[i].contentID]
		for k, id := range ids {
			if id == arrivals[i].ID {
				ids = append(ids[:k], ids[k+1:]...)
				break
			}
		}
		if len(ids) == 0 {
			delete(p.unacked, arrivals[i].contentID)
		} else {
			p.unacked[arrivals[i].contentID] = ids
		}
	}
}

// sessionEnded makes the session's unacked IDs orphans (the broker
// redelivers their deliveries) and forgets orphans older than orphanTTL.
func (p *publishIDs) sessionEnded(now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c, os := range p.orphans {
		kept := os[:0]
		for _, o := range os {
			if now.Sub(o.since) < orphanTTL {
				kept = append(kept, o)
			}
		}
		if len(kept) == 0 {
			delete(p.orphans, c)
		} else {
			p.orphans[c] = kept
		}
	}
	for c, ids := range p.unacked {
		for _, id := range ids {
			p.orphans[c] = append(p.orphans[c], orphan{id: id, since: now})
		}
	}
	p.unacked = map[string][]string{}
}
